r"""Greedy decode speed: our KV-cache sampler vs transformers `generate`, same weights, side by side.

  source scripts/env.sh   # tcmalloc for both sides, as the trainer runs (the header says which malloc)
  .venv/bin/python -m benchmarks.decode [--batch_sizes 1,16] [--new_tokens 64] [--repeats 5] \
      [--moe_impl dense,blocked] [--decode_kernel on,off]

Builds a ~20M-parameter random-init transformers `Qwen3VLMoeForConditionalGeneration` (8 MoE layers,
hidden 256, 8 experts top-2, a 4-block ViT) offline, saves it, loads it with `hf_io.load_pretrained`,
and for each batch size decodes `new_tokens` greedy tokens after a prompt with one 112x112 image on
both sides (ours compiled first; transformers in float32 eager mode with its dynamic KV cache; both
with all cores torch / XLA choose). After one untimed call of each side (our compilation), `repeats`
rounds each time one call of every side in turn, after 50 ms idle (`bench_model.interleaved_medians`,
as `train_step.py`: a change of the shared machine's load hits all sides alike); the table gives the
median times. The generated tokens are checked equal, so the table compares equal work. `--moe_impl`
takes a comma-separated list of our MoE paths (`ModelConfig.moe_impl`), each timed against the same
transformers run, with and without the FFI expert kernel of the decode loop (`--decode_kernel`,
`ModelConfig.moe_decode_kernel`; the table's "experts" column says which ran: "ffi" or "xla").
Prints one table: tokens/s of each side and the ratio.
"""

from __future__ import annotations

import tempfile

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks.bench_model import (allocator, hf_model, host_bandwidth, image_processor, interleaved_medians,
                                    moe_impl_name, overrides, torch_kernels)
from tars_jax.agent.tokenizer import BOS, IMAGE, PAD, VISION_END, VISION_START
from tars_jax.models import moe
from tars_jax.models.inference import sampler
from tars_jax.models.interop import hf_io

_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "16"], "Batch sizes to time.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Greedy tokens per row.")
_MOE = flags.DEFINE_list("moe_impl", None, "ModelConfig.moe_impl values of our model, comma-separated (None: "
                        "the config default).")
_KERNEL = flags.DEFINE_list("decode_kernel", ["on", "off"], "ModelConfig.moe_decode_kernel values of our model "
                            "(on / off), comma-separated; each combination with --moe_impl is timed.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved rounds of timed calls (the median is reported).")


def _on(value: str) -> bool:
  if value not in ("on", "off"):
    raise app.UsageError(f"--decode_kernel takes on / off, got {value!r}")
  return value == "on"


def _experts(cfg) -> str:
  """Which expert code the decode loop runs: the FFI kernel or XLA's dots (the decode layout of the
  model's `moe.MoeStrategy`, one device)."""
  return "ffi" if moe.select_strategy(jax.default_backend(), None, cfg.jdtype, cfg).decode == "ffi" else "xla"


def main(argv):
  del argv
  hf = hf_model()
  n_params = sum(p.numel() for p in hf.parameters())
  with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(d)
    models = [hf_io.load_pretrained(d, image_h=112, image_w=112, moe_decode_kernel=_on(kernel), **overrides(impl))
              for impl in (_MOE.value or [None]) for kernel in _KERNEL.value]
  proc = image_processor()
  rng = np.random.default_rng(0)
  n, rows = _NEW.value, []
  for b in (int(x) for x in _BATCHES.value):
    images = [rng.integers(0, 256, (112, 112, 3), dtype=np.uint8) for _ in range(b)]
    prompt = [BOS] + list(rng.integers(0, 256, 16)) + [VISION_START] + [IMAGE] * 16 + [VISION_END, 65]
    ids = np.tile(np.asarray(prompt, np.int64), (b, 1))
    mask = np.ones_like(ids)
    px = proc(images=images, return_tensors="np")
    kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
              pixel_values=torch.tensor(px["pixel_values"]), image_grid_thw=torch.tensor(px["image_grid_thw"]),
              mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)), max_new_tokens=n, min_new_tokens=n,
              do_sample=False, eos_token_id=None, pad_token_id=PAD)
    imgs = jnp.asarray(np.stack(images)[:, None] / 255.0, jnp.float32)
    toks, m = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)

    def ours_fn(model):
      return lambda: np.asarray(jax.block_until_ready(sampler.generate(
          model.policy, toks, m, imgs, None, jax.random.PRNGKey(0), max_new_tokens=n, temperature=0.0, eos_id=-1,
          pad_id=PAD).tokens))

    def hf_fn():
      with torch.no_grad():
        return hf.generate(**kw)[:, ids.shape[1]:].numpy()

    fns = {"transformers": hf_fn, **{i: ours_fn(ours) for i, ours in enumerate(models)}}
    out, t = interleaved_medians(fns, warmup=1, repeats=_REPEATS.value)  # warm-up: our compile
    for i, ours in enumerate(models):
      rows.append((moe_impl_name(ours.cfg), _experts(ours.cfg), b, b * n / t[i], b * n / t["transformers"], t["transformers"] / t[i],
                   bool(np.array_equal(out[i], out["transformers"]))))
  print(f"\ngreedy decode, {n_params / 1e6:.1f}M params (qwen3_vl_moe), prompt {len(prompt)} tokens incl. "
        f"one 112x112 image, {n} new tokens, median of {_REPEATS.value} interleaved rounds, "
        f"{jax.devices()[0].platform}, "
        f"torch threads {torch.get_num_threads()}, malloc {allocator()}, transformers {torch_kernels(hf)}, "
        f"{host_bandwidth()}")
  print(f"{'our MoE':>8} {'experts':>7} {'batch':>5} {'ours tok/s':>11} {'transformers tok/s':>19} {'ratio':>6} {'same tokens':>12}")
  for impl, experts, b, ours_tps, hf_tps, ratio, same in rows:
    print(f"{impl:>8} {experts:>7} {b:>5} {ours_tps:>11.1f} {hf_tps:>19.1f} {ratio:>5.2f}x {str(same):>12}")


if __name__ == "__main__":
  app.run(main)
