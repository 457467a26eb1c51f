r"""Train-step speed: our jitted forward+backward vs the transformers model in torch, same weights.

  source scripts/env.sh   # tcmalloc for both sides, as the trainer runs (the header says which malloc)
  .venv/bin/python -m benchmarks.train_step [--batch_sizes 4,16] [--seq 64] [--repeats 5] [--recompute_row] \
      [--noloop_row]

Builds the ~24M-parameter random-init transformers `Qwen3VLMoeForConditionalGeneration` of
`benchmarks/decode.py` offline, saves it and loads it with `hf_io.load_pretrained`, so both sides
compute the same function. One step = the LM cross-entropy over all tokens of a fixed-shape batch
(every row: text, one 112x112 image = 16 merged image tokens, text; `seq` tokens; next-token loss
over positions 1..T-1, mean) and its gradient with respect to every parameter (vision encoder
included): ours `jax.jit(jax.value_and_grad(loss))` on the `Policy`; torch `model(..., labels=ids)`
then `loss.backward()` (transformers' defaults: sdpa attention, its default experts kernel). Rows:
  ours f32     params and compute float32;
  ours bf16    the same float32 parameters with `ModelConfig.dtype = "bfloat16"` (activations and
               matmuls in bfloat16, logits / softmax / loss in float32);
  ours f32 rc  (with --recompute_row) ours f32 with `ModelConfig.attention_impl = "recompute"`;
  ours f32 loop  (unless --noloop_row; "grouped" only) ours f32 with `moe_grouped_blas = False`: the
               experts in XLA's while loop instead of the OpenBLAS custom calls (`expert_kernel.py`);
  torch f32    transformers in float32 eager mode.
Warm-up calls (compilation included) are not timed; then `repeats` rounds each time one step of every
row in turn (interleaved: the machine may be shared, load changes hit all rows alike), each timed step
after 50 ms idle (`PAUSE_S`: torch's OpenMP workers spin for a while after its step). The table gives
the median step time as tokens/s = batch * seq / median, and the loss and global gradient norm of each side (f32 rows
must agree: the sanity check that both compute the same thing).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from benchmarks.bench_model import (IMAGE_HW, allocator, hf_model, host_bandwidth, image_processor, interleaved_medians,
                                    lm_loss, make_batch, moe_impl_name, overrides, torch_kernels)
from tars_jax.agent.tokenizer import IMAGE
from tars_jax.models import Policy
from tars_jax.models.interop import hf_io
from tars_jax.models.rope import rope_positions

_BATCHES = flags.DEFINE_list("batch_sizes", ["4", "16"], "Batch sizes to time.")
_SEQ = flags.DEFINE_integer("seq", 64, "Tokens per row (including the 16 image tokens).")
_MOE = flags.DEFINE_string("moe_impl", None, "ModelConfig.moe_impl of our model (None: the config default).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed steps per setting (the median is reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps first (compilation, allocator warm-up).")
_LOOP = flags.DEFINE_bool("loop_row", True, "With --moe_impl grouped, also time our float32 step with "
                          "moe_grouped_blas=False (XLA's expert loop instead of the OpenBLAS kernel).")
_RECOMPUTE = flags.DEFINE_bool("recompute_row", False, "Also time our float32 step with attention_impl='recompute' "
                               "(the memory-lean attention backward).")

_step = jax.jit(jax.value_and_grad(lm_loss), static_argnums=1)


def global_norm(tree) -> float:
  return float(jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))))


def main(argv):
  del argv
  hf = hf_model().train()
  n_params = sum(p.numel() for p in hf.parameters())
  with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(d)
    ours = hf_io.load_pretrained(d, image_h=IMAGE_HW, image_w=IMAGE_HW, **overrides(_MOE.value))
  f32 = nnx.split(ours.policy)
  bf16 = nnx.split(ours.with_compute_dtype(jnp.bfloat16).policy)
  rec = None  # with --recompute_row: the same float32 parameters under the other attention core's graph
  if _RECOMPUTE.value:
    rec_cfg = dataclasses.replace(ours.cfg, attention_impl="recompute")
    rec = (nnx.split(nnx.eval_shape(lambda: Policy(rec_cfg, nnx.Rngs(0))))[0], f32[1])
  loop = None  # the same float32 parameters with the experts in XLA's loop
  if _LOOP.value and ours.cfg.moe_impl == "grouped":
    loop_cfg = dataclasses.replace(ours.cfg, moe_grouped_blas=False)
    loop = (nnx.split(nnx.eval_shape(lambda: Policy(loop_cfg, nnx.Rngs(0))))[0], f32[1])
  proc = image_processor()
  cfg = ours.cfg
  rng = np.random.default_rng(0)
  seq = _SEQ.value
  xla = os.environ.get("XLA_FLAGS", "(unset)")
  print(f"\ntrain step (forward + backward, LM cross-entropy), {n_params / 1e6:.1f}M params (qwen3_vl_moe, our MoE "
        f"{moe_impl_name(cfg)!r}), "
        f"{seq} tokens/row incl. one {IMAGE_HW}x{IMAGE_HW} image; median of {_REPEATS.value} interleaved rounds after "
        f"{_WARMUP.value} warm-up; {jax.devices()[0].platform} ({os.cpu_count()} cores visible), "
        f"torch threads {torch.get_num_threads()}, XLA_FLAGS {xla}, malloc {allocator()}, transformers "
        f"{torch_kernels(hf)}, {host_bandwidth()}")
  print(f"{'batch':>5} {'model':>13} {'tokens/s':>9} {'vs torch':>9} {'loss':>10} {'grad norm':>11}", flush=True)
  for b in (int(x) for x in _BATCHES.value):
    ids, images = make_batch(rng, b, seq)
    px = proc(images=list(images), return_tensors="np")
    kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
              pixel_values=torch.tensor(px["pixel_values"]), image_grid_thw=torch.tensor(px["image_grid_thw"]),
              mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)), labels=torch.tensor(ids))

    def torch_step():
      hf.zero_grad(set_to_none=True)
      loss = hf(**kw).loss
      loss.backward()
      return loss

    toks = jnp.asarray(ids, jnp.int32)
    mask = jnp.ones(toks.shape, bool)
    pos = rope_positions(toks, mask, cfg.image_token_id, cfg.merged_grid)
    pix = jnp.asarray(images[:, None] / 255.0, jnp.float32)

    def ours_step(gd, params):
      return lambda: jax.block_until_ready(_step(params, gd, toks, pos, mask, pix))

    fns = {"ours f32": ours_step(*f32), "ours bf16": ours_step(*bf16)}
    if rec is not None:
      fns["ours f32 rc"] = ours_step(*rec)
    if loop is not None:
      fns["ours f32 loop"] = ours_step(*loop)
    out, t = interleaved_medians({**fns, "torch f32": torch_step}, _WARMUP.value, _REPEATS.value)
    rows = []
    for name in fns:
      loss, grads = out[name]
      rows.append((name, b * seq / t[name], t["torch f32"] / t[name], float(loss), global_norm(grads)))
    gnorm_t = float(torch.sqrt(sum(torch.sum(p.grad.double() ** 2) for p in hf.parameters() if p.grad is not None)))
    rows.append(("torch f32", b * seq / t["torch f32"], 1.0, float(out["torch f32"].detach()), gnorm_t))
    for name, tps, ratio, loss, gn in rows:
      print(f"{b:>5} {name:>13} {tps:>9.1f} {ratio:>8.2f}x {loss:>10.6f} {gn:>11.5f}", flush=True)


if __name__ == "__main__":
  app.run(main)
