r"""Train-step MFU on an accelerator (issue #3 item 6): our jitted forward + backward of a Qwen3-VL-MoE
policy in bfloat16, its model FLOPs utilisation, and transformers in torch on the same GPU and weights.

  python -m benchmarks.train_step_gpu [--preset a3b8] [--batch 4] [--seq 1024] [--remat none] \
      [--attention_impl einsum] [--attention_block 64] [--moe_impls ragged,dense,blocked,grouped] [--torch] \
      [--json out.json]

The model (`--preset a3b8`, 3.44B parameters; per token 0.45B active decoder weights + the 0.31B LM
head): the layer shapes of Qwen3-VL-30B-A3B — text hidden 2048, 32 query / 4 KV heads of 128, experts of width 768 with top-8
routing, vocabulary 151 936; vision hidden 1152, 16 heads, MLP 4304, patch 16, temporal patch 2,
DeepStack — with 8 of its 48 decoder layers, 64 of its 128 experts and 8 of its 27 vision blocks; one
448 x 448 image = 196 merged tokens per row. Layers are scanned (`scan_layers=True`). Memory, measured
on an H200 (benchmarks/RESULTS.md, 2026-11-26): float32 parameters and gradients are 2 x 13.8 GB; our
step's temporaries (`compiled.memory_analysis()`, the "temp GB" column) at batch 4 x 1024 are 26 GB
(grouped), 33 GB (blocked), 42 GB (dense); at batch 8, 47 / 62 / 84 GB (dense does not fit a 141 GB
H200 then); with `--remat full` 5.4 (blocked) / 7.4 GB (dense) at batch 8, for 3.5 % more step time.
torch peaked at 32.5 GB (batch 4) and 50.7 GB (batch 8). Hence the default batch 4, and JAX may take
92 % of the GPU (torch has given its cache back before our rows run). Those H200 rows predate
`attention_block`: they ran one full causal square per layer (`--attention_block 0`).

One step = mean next-token cross-entropy over every row (positions 1..T-1) and its gradient with
respect to every float32 parameter (vision encoder included), activations and matmuls in bfloat16
(`ModelConfig.dtype = "bfloat16"`): ours `jax.jit(jax.value_and_grad(loss))`; torch: transformers'
`Qwen3VLMoeForConditionalGeneration` with float32 parameters under `torch.autocast(bfloat16)`, its
default attention (sdpa) and experts kernels, `loss.backward()`. With `--torch` (default) transformers
initialises the weights, saves them, and ours loads them with `hf_io.load_pretrained`: both sides
compute the same function (the loss columns agree to bfloat16 rounding); without it ours starts from
its own random init.

MFU = model FLOPs of the step (`tars_jax.models.flops`: 3 x the forward's matmuls with top-k experts
and causal attention counted at the pairs the mask keeps) / median step time / peak. Peak: the
datasheet dense bfloat16 rate of the GPU (H100/H200 SXM: 989 TFLOP/s) and, measured in the same run,
an 8192^3 bfloat16 `jnp.dot`. "XLA TFLOP" is the compiled program's own count (`cost_analysis`):
what it executes, e.g. the dense MoE's all-experts einsum (experts / top_k x the expert FLOPs) and
the attention squares our einsum attention computes under the causal mask (per causal block).
Times are medians of `--repeats` steps after `--warmup` untimed ones (compilation reported apart).
On a GPU, XLA's `cost_analysis` leaves out the matmuls it hands to cuBLAS / cuDNN (custom calls): its
count there is far below the model FLOPs (0.4-1.5 T against 22.8 T per batch-4 step) and only the CPU
figure is comparable.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the device
# torch empties its cache before our rows; the default 75 % cap left the batch-8 rows out of memory
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import dataclasses
import json
import statistics
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.bench_model import PRESETS, bench_config, image_processor, torch_kernels
from benchmarks.bench_model import datasheet_peak, lm_loss, make_batch
from tars_jax.agent.tokenizer import IMAGE
from tars_jax.models import flops
from tars_jax.models.interop import hf_io
from tars_jax.models.interop.hf_model import HFModel
from tars_jax.models.rope import rope_positions

_PRESET = flags.DEFINE_string("preset", "a3b8", "Model preset: " + ", ".join(PRESETS))
_BATCH = flags.DEFINE_integer("batch", 4, "Rows per step (8 fits the blocked / grouped MoE on a 141 GB H200).")
_SEQ = flags.DEFINE_integer("seq", 1024, "Tokens per row (including one image's merged tokens).")
_IMPLS = flags.DEFINE_list("moe_impls", ["ragged", "dense", "blocked", "grouped"], "Our MoE paths to time.")
_REMAT = flags.DEFINE_string("remat", "none", "ModelConfig.remat of our rows: none | full | dots.")
_ATTN = flags.DEFINE_string("attention_impl", "einsum", "ModelConfig.attention_impl of our rows: einsum | recompute.")
_BLOCK = flags.DEFINE_integer("attention_block", 64, "ModelConfig.attention_block of our rows (0: one full square).")
_TORCH = flags.DEFINE_bool("torch", True, "Also time transformers in torch (and share its weights).")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed steps per row (median reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps first.")
_JSON = flags.DEFINE_string("json", None, "Write the table as JSON here.")

def timed(fn, warmup: int, repeats: int) -> tuple[object, float]:
  """(last output, median seconds of `repeats` calls) after `warmup` untimed calls; fn must block."""
  out = None
  for _ in range(warmup):
    out = fn()
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    ts.append(time.perf_counter() - t0)
  return out, statistics.median(ts)


def matmul_peak(n: int = 8192, repeats: int = 20) -> float:
  """Measured bf16 FLOP/s of one jitted n x n x n `jnp.dot` (random inputs, float32 accumulation)."""
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.random.normal(k1, (n, n), jnp.bfloat16)
  b = jax.random.normal(k2, (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  _, t = timed(lambda: jax.block_until_ready(f(a, b)), 3, repeats)
  return 2.0 * n ** 3 / t


def torch_row(path: str, ids, px, repeats: int, warmup: int) -> dict:
  """Loads the checkpoint in transformers on the GPU, times autocast-bf16 forward + backward steps."""
  import torch
  from transformers import Qwen3VLMoeForConditionalGeneration
  dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the smoke preset's end-to-end check
  model = Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).to(dev).train()
  kw = dict(input_ids=torch.tensor(ids, device=dev), attention_mask=torch.ones(ids.shape, dtype=torch.long, device=dev),
            pixel_values=torch.tensor(px["pixel_values"], device=dev),
            image_grid_thw=torch.tensor(px["image_grid_thw"], device=dev),
            mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64), device=dev),
            labels=torch.tensor(ids, device=dev))

  def step():
    model.zero_grad(set_to_none=True)
    with torch.autocast(dev, dtype=torch.bfloat16):
      loss = model(**kw).loss
    loss.backward()
    if dev == "cuda":
      torch.cuda.synchronize()
    return loss

  t0 = time.perf_counter()
  step()
  first = time.perf_counter() - t0
  loss, t = timed(step, max(0, warmup - 1), repeats)
  row = dict(name="torch (transformers)", seconds=t, first_call_s=first, loss=float(loss.detach()),
             kernels=torch_kernels(model),
             peak_mem_gb=torch.cuda.max_memory_allocated() / 2 ** 30 if dev == "cuda" else float("nan"))
  del model, kw, loss
  if dev == "cuda":
    torch.cuda.empty_cache()
  return row


def ours_row(model: HFModel, impl: str, batch, repeats: int, warmup: int) -> dict:
  """Times our bf16-compute train step with `moe_impl=impl` over `model`'s float32 parameters."""
  cfg = dataclasses.replace(model.cfg, moe_impl=impl, dtype="bfloat16", remat=_REMAT.value,
                            attention_impl=_ATTN.value, attention_block=_BLOCK.value)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: HFModel(cfg, nnx.Rngs(0))))
  policy = nnx.merge(graphdef, nnx.state(model)).policy
  gd, params = nnx.split(policy)
  step = jax.jit(jax.value_and_grad(lm_loss), static_argnums=1)
  t0 = time.perf_counter()
  compiled = step.lower(params, gd, *batch).compile()
  compile_s = time.perf_counter() - t0
  cost = compiled.cost_analysis()
  xla_flops = float((cost[0] if isinstance(cost, list) else cost).get("flops", float("nan")))
  mem = compiled.memory_analysis()  # the step's own buffers (peak_bytes_in_use is the process's maximum so far)
  temp_gb = getattr(mem, "temp_size_in_bytes", float("nan")) / 2 ** 30
  (loss, grads), t = timed(lambda: jax.block_until_ready(compiled(params, *batch)), warmup, repeats)
  stats = jax.devices()[0].memory_stats() or {}
  return dict(name=f"ours {impl}", seconds=t, compile_s=compile_s, loss=float(loss), xla_flops=xla_flops,
              temp_gb=temp_gb, peak_mem_gb=stats.get("peak_bytes_in_use", float("nan")) / 2 ** 30)


def main(argv):
  del argv
  cfg = bench_config(_PRESET.value)
  b, seq = _BATCH.value, _SEQ.value
  dev = jax.devices()[0]
  n_img = cfg.n_img_tokens
  ids, images = make_batch(np.random.default_rng(0), b, seq, n_img=n_img, image_hw=cfg.image_h)
  model_flops = flops.forward_flops(cfg, b, seq, images_per_row=1).train_step
  peak_ds = datasheet_peak(dev.device_kind)
  t0 = time.perf_counter()
  peak_mm = matmul_peak() if dev.platform == "gpu" else matmul_peak(1024, 3)
  rows = []
  with tempfile.TemporaryDirectory() as d:
    if _TORCH.value:
      import torch
      from transformers import Qwen3VLMoeForConditionalGeneration
      torch.manual_seed(0)
      with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        hf = Qwen3VLMoeForConditionalGeneration(hf_io.config_to_hf(cfg))
      hf.save_pretrained(d)
      del hf
      if torch.cuda.is_available():
        torch.cuda.empty_cache()  # give its 14 GB back before the timed model is loaded
      print(f"[bench] transformers model built and saved: {time.perf_counter() - t0:.0f} s", flush=True)
      px = image_processor(cfg.patch_size)(images=list(images), return_tensors="np")
      try:
        rows.append(torch_row(d, ids, px, _REPEATS.value, _WARMUP.value))
      except Exception as e:  # noqa: BLE001 - a failing side is a row of the table, not the end of the run
        rows.append(dict(name="torch (transformers)", error=f"{type(e).__name__}: {str(e)[:300]}"))
      print(f"[bench] torch row: {rows[-1]}", flush=True)
      model = hf_io.load_pretrained(d, image_h=cfg.image_h, image_w=cfg.image_w, scan_layers=True)
    else:
      model = nnx.jit(lambda: HFModel(cfg, nnx.Rngs(0)))()
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

  def write_json(rows):
    if _JSON.value:
      with open(_JSON.value, "w") as f:
        json.dump(dict(device=dev.device_kind, preset=_PRESET.value, config=cfg.to_dict(), batch=b, seq=seq,
                       params=n_params, model_flops_per_step=model_flops, peak_datasheet=peak_ds,
                       peak_measured=peak_mm, remat=_REMAT.value, attention_impl=_ATTN.value,
                       attention_block=_BLOCK.value, jax=jax.__version__, rows=rows), f, indent=1, default=str)

  write_json(rows)
  toks = jnp.asarray(ids, jnp.int32)
  mask = jnp.ones(toks.shape, bool)
  pos = rope_positions(toks, mask, cfg.image_token_id, cfg.merged_grid)
  pix = jnp.asarray(images[:, None] / 255.0, jnp.float32)
  for impl in _IMPLS.value:
    try:
      rows.append(ours_row(model, impl, (toks, pos, mask, pix), _REPEATS.value, _WARMUP.value))
    except Exception as e:  # noqa: BLE001 - e.g. out of memory for the dense MoE: report and go on
      rows.append(dict(name=f"ours {impl}", error=f"{type(e).__name__}: {str(e)[:300]}"))
    print(f"[bench] {rows[-1]}", flush=True)
    write_json(rows)  # each row as it lands: a run cut off at its time limit keeps what it measured

  tokens = b * seq
  torch_s = next((r["seconds"] for r in rows if r["name"].startswith("torch") and "seconds" in r), None)
  print(f"\ntrain step (fwd + bwd, bf16 compute, f32 params) on {dev.device_kind} ({dev.platform}); preset "
        f"{_PRESET.value}: {n_params / 1e9:.2f}B params, {flops.active_decoder_params_per_token(cfg) / 1e9:.2f}B "
        f"active decoder params/token; batch {b} x {seq} tokens (one {cfg.image_h}x{cfg.image_w} image = {n_img} "
        f"tokens/row); model FLOPs/step {model_flops / 1e12:.1f} T; peak bf16: datasheet "
        f"{(peak_ds or float('nan')) / 1e12:.0f}, measured {peak_mm / 1e12:.0f} TFLOP/s; remat {_REMAT.value}, "
        f"attention {_ATTN.value} block {_BLOCK.value}; "
        f"jax {jax.__version__}")
  print(f"{'row':>22} {'step ms':>8} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU ds':>7} {'MFU meas':>8} "
        f"{'vs torch':>8} {'XLA TFLOP':>9} {'compile s':>9} {'loss':>9} {'peak GB':>7} {'temp GB':>7}")
  for r in rows:
    if "error" in r:
      print(f"{r['name']:>22}  failed: {r['error']}")
      continue
    s = r["seconds"]
    ach = model_flops / s
    r.update(tokens_per_s=tokens / s, model_tflops_per_s=ach / 1e12, mfu_datasheet=ach / peak_ds if peak_ds else None,
             mfu_measured_peak=ach / peak_mm, vs_torch=(torch_s / s) if torch_s else None)
    mfu_ds = f"{100 * r['mfu_datasheet']:.1f}%" if peak_ds else "-"
    vs = f"{r['vs_torch']:.2f}x" if r["vs_torch"] else "-"
    xf = f"{r['xla_flops'] / 1e12:.1f}" if "xla_flops" in r else "-"
    cs = f"{r.get('compile_s', r.get('first_call_s', 0)):.1f}"
    print(f"{r['name']:>22} {1e3 * s:>8.1f} {tokens / s:>9.0f} {ach / 1e12:>8.1f} {mfu_ds:>7} "
          f"{100 * r['mfu_measured_peak']:>7.1f}% {vs:>8} {xf:>9} {cs:>9} {r['loss']:>9.5f} {r['peak_mem_gb']:>7.1f} {r.get('temp_gb', float('nan')):>7.1f}")
  write_json(rows)


if __name__ == "__main__":
  app.run(main)
