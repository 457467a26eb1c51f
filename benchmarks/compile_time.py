r"""Compile time of the train step with and without scanned layers (`ModelConfig.scan_layers`: the
decoder layers and the vision blocks).

  .venv/bin/python -m benchmarks.compile_time [--layers 4,16] [--vision_depth 2] [--batch 4] [--seq 64]

For each depth and scan off/on: the `tiny()` policy (4 experts top-2, hidden 128, 224x168 images)
with `layers` decoder layers and `vision_depth` vision blocks; the step is
`jax.jit(jax.value_and_grad(loss))` of the next-token cross-entropy + 0.01 * MoE aux loss over a
[batch, seq] batch with one image per row, traced and compiled for abstract parameters (`nnx.eval_shape`: nothing is initialised or run). Columns: seconds
to trace + lower to StableHLO, seconds for XLA to compile, and the size of the lowered module text
(the unrolled step grows with depth; the scanned one should not). One process, cold caches per row
(each depth/scan pair is a different function) after one untimed warm-up compile; no timings are asserted anywhere.
"""

from __future__ import annotations

import time

from absl import app, flags
import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.models import ModelConfig, Policy

_LAYERS = flags.DEFINE_list("layers", ["4", "16"], "Decoder depths to compile.")
_BATCH = flags.DEFINE_integer("batch", 4, "Rows per batch.")
_SEQ = flags.DEFINE_integer("seq", 64, "Tokens per row (at least n_img_tokens + 2).")
_REMAT = flags.DEFINE_string("remat", "none", "ModelConfig.remat of every row.")
_VISION_DEPTH = flags.DEFINE_integer("vision_depth", ModelConfig.tiny().vision_depth, "Vision blocks of every row.")


def compile_seconds(cfg: ModelConfig, batch: int, seq: int) -> tuple[float, float, int]:
  """(trace + lower seconds, compile seconds, StableHLO text chars) of the train step of `cfg`."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Policy(cfg, nnx.Rngs(0))))
  n_img = cfg.n_img_tokens
  if seq < n_img + 2:
    raise ValueError(f"seq={seq} < n_img_tokens + 2 = {n_img + 2}")
  toks = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  pos = jax.ShapeDtypeStruct((3, batch, seq), jnp.int32)
  mask = jax.ShapeDtypeStruct((batch, seq), jnp.bool_)
  pix = jax.ShapeDtypeStruct((batch, 1, cfg.image_h, cfg.image_w, 3), jnp.float32)

  def loss(p, toks, pos, mask, pix):
    logits, aux, _, _ = nnx.merge(graphdef, p)(toks, pos, mask, pix)
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    nll = -jnp.take_along_axis(logp, toks[:, 1:, None], -1)[..., 0]
    w = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0) + 0.01 * aux

  t0 = time.perf_counter()
  lowered = jax.jit(jax.value_and_grad(loss)).lower(params, toks, pos, mask, pix)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return t1 - t0, t2 - t1, len(lowered.as_text())


def main(argv):
  del argv
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; batch {_BATCH.value} x seq {_SEQ.value}, "
        f"remat {_REMAT.value}, {_VISION_DEPTH.value} vision blocks")
  compile_seconds(ModelConfig.tiny(layers=1), _BATCH.value, _SEQ.value)  # untimed: one-time JAX/XLA warm-up
  print(f"{'layers':>6} {'scan':>5} {'lower s':>8} {'compile s':>10} {'HLO chars':>10}")
  for n in (int(x) for x in _LAYERS.value):
    for scan in (False, True):
      cfg = ModelConfig.tiny(layers=n, vision_depth=_VISION_DEPTH.value, remat=_REMAT.value, scan_layers=scan)
      lower, comp, size = compile_seconds(cfg, _BATCH.value, _SEQ.value)
      print(f"{n:>6} {'on' if scan else 'off':>5} {lower:>8.2f} {comp:>10.2f} {size:>10}", flush=True)


if __name__ == "__main__":
  app.run(main)
