"""The shared parts of the issue-#3 benchmarks (`decode.py`, `train_step.py`, `train_step_gpu.py`,
`train_step_memory.py`): a ~24M-parameter random-init transformers `Qwen3VLMoeForConditionalGeneration`
built offline, its image processor, the train-step batch layout and LM loss, the accelerator presets,
the datasheet peak and the compiled step's memory.

No absl flags here: tests import this module, and a flag defined at import time in two modules loaded
by one pytest process is a `DuplicateFlagError` (`tests/test_flag_imports.py` guards it)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from tars_jax.agent.tokenizer import BOS, IMAGE, VISION_END, VISION_START
from tars_jax.models.config import ModelConfig
from tars_jax.models.policy import Policy


def hf_model():
  """8 MoE decoder layers (hidden 256, 8 heads / 4 KV heads, 8 experts top-2, expert width 384) over our
  264-token byte vocabulary, a 4-block ViT (hidden 192, patch 14, DeepStack from block 1); seed 0, eval mode."""
  from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
  cfg = Qwen3VLMoeConfig(
      text_config=dict(vocab_size=264, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, moe_intermediate_size=384,
                       num_experts=8, num_experts_per_tok=2, initializer_range=0.2,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[8, 4, 4],
                                            mrope_interleaved=True)),
      vision_config=dict(depth=4, hidden_size=192, intermediate_size=768, num_heads=4, patch_size=14,
                         temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=256,
                         num_position_embeddings=64, deepstack_visual_indexes=[1]),
      image_token_id=IMAGE, video_token_id=263, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
  torch.manual_seed(0)
  return Qwen3VLMoeForConditionalGeneration(cfg).eval()


def image_processor(patch_size: int = 14):
  """transformers' Qwen2-VL image processor without resizing, mean / std 0.5 (our `pixel_norm`)."""
  from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
  return Qwen2VLImageProcessorPil(do_resize=False, patch_size=patch_size, temporal_patch_size=2, merge_size=2,
                                  image_mean=[0.5] * 3, image_std=[0.5] * 3)


def torch_kernels(model) -> str:
  """Which attention / experts implementations the transformers model runs (for the table header)."""
  tc = model.config.text_config
  return (f"attention {getattr(tc, '_attn_implementation', None)!r}, "
          f"experts {getattr(tc, '_experts_implementation', None)!r}")


def allocator() -> str:
  """The malloc this process runs (for table headers; both sides of a benchmark share it):
  "tcmalloc" when `scripts/env.sh` preloaded it, else "glibc"."""
  with open("/proc/self/maps") as f:
    return "tcmalloc" if "libtcmalloc" in f.read() else "glibc"


def host_bandwidth(mb: int = 40, rounds: int = 20) -> str:
  """This host's memory read bandwidth right now, for table headers ("host read bandwidth 10.0 / 16.5
  GB/s (1 / 2 threads)"): NumPy sums of a `mb`-MB float64 array (larger than the caches) from one and
  from two threads. On the shared VM it has ranged from 24 / 30 (2026-11-24) to 10 / 16.5 GB/s
  (2026-11-26), and the batch-16 decode, which streams every expert's weights each step, moves with it
  more than transformers does."""
  import threading
  a = np.ones(mb * 2 ** 20 // 8)
  a.sum()

  def read():
    for _ in range(rounds):
      a.sum()

  def rate(threads: int) -> float:
    ts = [threading.Thread(target=read) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
      t.start()
    for t in ts:
      t.join()
    return threads * rounds * a.nbytes / (time.perf_counter() - t0) / 1e9

  return f"host read bandwidth {rate(1):.1f} / {rate(2):.1f} GB/s (1 / 2 threads)"


def overrides(moe_impl: str | None) -> dict:
  """`ModelConfig` overrides for `hf_io.load_pretrained`: `moe_impl` when given (the MoE compute path,
  a field the scaling work adds; None keeps the config's default). Raises ValueError when the installed
  `ModelConfig` has no such field."""
  import dataclasses

  if moe_impl is None:
    return {}
  if "moe_impl" not in {f.name for f in dataclasses.fields(ModelConfig)}:
    raise ValueError("--moe_impl given but ModelConfig has no field 'moe_impl' in this checkout")
  return {"moe_impl": moe_impl}


def moe_impl_name(cfg) -> str:
  """The MoE compute path a config runs ('dense' when the config predates the `moe_impl` field)."""
  return str(getattr(cfg, "moe_impl", "dense"))


def best_time(fn, repeats: int, warmup: int = 0):
  """(last output of fn(), best wall time of `repeats` timed calls in seconds) after `warmup`
  untimed calls (compilation)."""
  for _ in range(warmup):
    fn()
  out, best = None, float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - t0)
  return out, best


# Idle time before each timed call: torch's OpenMP workers spin after a step (~9 ms of CPU in the
# 200 ms after a torch step, 0.1 ms after ours; getrusage, 2026-11-24), which the next call would pay.
PAUSE_S = 0.05


def interleaved_medians(fns: dict, warmup: int, repeats: int, pause_s: float = PAUSE_S) -> tuple[dict, dict]:
  """Runs every fn `warmup` times untimed, then `repeats` rounds of one timed call of each fn in turn
  (interleaved, so a change of the shared machine's load hits all sides alike), each after `pause_s`
  seconds idle. Returns ({name: last output}, {name: median seconds})."""
  out = {}
  for name, fn in fns.items():
    for _ in range(warmup):
      out[name] = fn()
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      time.sleep(pause_s)
      t0 = time.perf_counter()
      out[name] = fn()
      times[name].append(time.perf_counter() - t0)
  return out, {name: statistics.median(t) for name, t in times.items()}


IMAGE_HW = 112
N_IMG = 16  # (112 / 14 / 2)^2 merged tokens


def make_batch(rng: np.random.Generator, batch: int, seq: int, n_img: int = N_IMG, image_hw: int = IMAGE_HW):
  """Fixed-shape rows `BOS text <vs> IMAGE*n_img <ve> text` -> (ids [B, T] int64, images [B, H, W, 3]
  uint8), one `image_hw` x `image_hw` image per row whose merged tokens are the `n_img` IMAGE slots.
  Raises ValueError when `seq` leaves no room for text after the image."""
  head = 1 + 8
  tail = seq - head - n_img - 2
  if tail < 1:
    raise ValueError(f"seq={seq} too short for one image ({n_img} tokens) and some text; need >= {head + n_img + 3}")
  rows = [[BOS] + list(rng.integers(0, 256, head - 1)) + [VISION_START] + [IMAGE] * n_img + [VISION_END]
          + list(rng.integers(0, 256, tail)) for _ in range(batch)]
  images = rng.integers(0, 256, (batch, image_hw, image_hw, 3), dtype=np.uint8)
  return np.asarray(rows, np.int64), images


def lm_loss(params, graphdef, tokens, positions, mask, pixels):
  """Mean next-token cross-entropy (float32 scalar) over positions 1..T-1 of every row."""
  policy = nnx.merge(graphdef, params)
  logits = policy(tokens, positions, mask, pixels).logits
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


# Model presets of the accelerator benchmarks (`train_step_gpu.py`, `train_step_memory.py`).
PRESETS = {
    # Qwen3-VL-30B-A3B layer shapes; 8 of 48 layers, 64 of 128 experts, 8 of 27 vision blocks.
    "a3b8": dict(vocab_size=151936, hidden=2048, layers=8, heads=32, kv_heads=4, head_dim=128, experts=64,
                 top_k=8, moe_intermediate=768, dense_intermediate=6144, rope_theta=5e6, mrope_section=(24, 20, 20),
                 patch_size=16, temporal_patch_size=2, vision_hidden=1152, vision_depth=8, vision_heads=16,
                 vision_mlp=4304, deepstack_visual_indexes=(2, 4, 6), image_h=448, image_w=448),
    # a few seconds on a CPU: checks the script end to end
    "smoke": dict(vocab_size=1024, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2,
                  moe_intermediate=128, patch_size=16, temporal_patch_size=2, vision_hidden=64, vision_depth=2,
                  vision_heads=2, vision_mlp=128, deepstack_visual_indexes=(0,), image_h=64, image_w=64),
}


def bench_config(preset: str, **overrides) -> ModelConfig:
  """The preset's `ModelConfig` (scanned layers); raises KeyError naming the known presets."""
  if preset not in PRESETS:
    raise KeyError(f"unknown preset {preset!r}; known: {list(PRESETS)}")
  return ModelConfig(**{**PRESETS[preset], "scan_layers": True, **overrides})


# Dense bfloat16 tensor-core peak of the SXM parts, datasheet (FLOP/s).
DATASHEET_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "B200": 2250e12}

def datasheet_peak(device_kind: str) -> float | None:
  """Dense bf16 FLOP/s of a device by its `device_kind` (e.g. 'NVIDIA H100 80GB HBM3'), None if unknown."""
  return next((v for k, v in DATASHEET_BF16.items() if k in device_kind), None)


def step_memory(cfg, batch: int, seq: int) -> dict:
  """Bytes of the compiled value-and-grad step of `Policy(cfg)` on [batch, seq] tokens with one
  image per row: {"temp", "args", "out"} (ints, bytes) and "compile_s"; nothing is executed."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Policy(cfg, nnx.Rngs(0))))
  toks = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  mask = jax.ShapeDtypeStruct((batch, seq), jnp.bool_)
  pos = jax.ShapeDtypeStruct((3, batch, seq), jnp.int32)
  pix = jax.ShapeDtypeStruct((batch, 1, cfg.image_h, cfg.image_w, 3), jnp.float32)
  t0 = time.perf_counter()
  compiled = jax.jit(jax.value_and_grad(lm_loss), static_argnums=1).lower(params, graphdef, toks, pos, mask,
                                                                          pix).compile()
  m = compiled.memory_analysis()
  return dict(temp=m.temp_size_in_bytes, args=m.argument_size_in_bytes, out=m.output_size_in_bytes,
              compile_s=time.perf_counter() - t0)
