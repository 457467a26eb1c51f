"""Policy / critic models (Flax NNX, transformers `qwen3_vl_moe`).

The readable core sits here (config, rope, attention, vision, decoder, the reference MoE, policy,
value); `inference/` holds the KV-cache sampler, slot decoding and quantised serving weights;
`fast/` the grouped / expert-parallel MoE paths and the CPU kernels; `interop/` transformers
checkpoints, the reference model wrapper and tiny offline test checkpoints."""

from tars_jax.models.config import ModelConfig
from tars_jax.models.decoder import KVCache, init_cache
from tars_jax.models.inference.sampler import Generation, constrained_log_softmax, generate, token_logprobs
from tars_jax.models.policy import Policy, Trunk
from tars_jax.models.rope import next_position, rope_positions
from tars_jax.models.value import ValueModel
from tars_jax.models.interop import hf_io  # noqa: E402  (needs the modules above)

__all__ = ["ModelConfig", "Policy", "Trunk", "ValueModel", "KVCache", "init_cache", "rope_positions",
           "next_position", "Generation", "generate", "token_logprobs", "constrained_log_softmax"]
