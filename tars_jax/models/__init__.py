"""Policy / critic models (Flax NNX, transformers `qwen3_vl_moe`), the KV-cache sampler, and
transformers checkpoint I/O (`hf_io`)."""

from tars_jax.models.config import ModelConfig
from tars_jax.models.decoder import KVCache, init_cache
from tars_jax.models.policy import Policy, Trunk
from tars_jax.models.rope import next_position, rope_positions
from tars_jax.models.sampler import Generation, constrained_log_softmax, generate, token_logprobs
from tars_jax.models.value import ValueModel
from tars_jax.models import hf_io  # noqa: E402  (needs the modules above)

__all__ = ["ModelConfig", "Policy", "Trunk", "ValueModel", "KVCache", "init_cache", "rope_positions",
           "next_position", "Generation", "generate", "token_logprobs", "constrained_log_softmax"]
