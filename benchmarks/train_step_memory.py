r"""Train-step memory without running it: XLA's buffer sizes of the compiled step per config variant.

  python -m benchmarks.train_step_memory [--preset a3b8] [--batch 4] [--seq 1024] [--attention_block 64] \
      [--variants dense:einsum:none,dense:recompute:none,grouped:einsum:none,grouped:recompute:none]

Each variant is `moe_impl:attention_impl:remat` of `ModelConfig`. The step is `benchmarks/
train_step_gpu.py`'s (mean next-token cross-entropy and its gradient with respect to every float32
parameter, bfloat16 compute, scanned layers, one image per row), lowered with abstract arguments
(`jax.ShapeDtypeStruct`: no parameter is allocated, so the 3.44B preset fits a laptop) and compiled for
this process's default backend; `compiled.memory_analysis()` gives the bytes of its arguments
(parameters, batch), outputs (loss, gradients) and temporaries (activations kept for the backward,
workspace). Temporaries differ between backends (XLA:CPU and XLA:GPU fuse differently): compare
variants within one table, not a CPU table with a GPU run. Prints one table.
"""

from __future__ import annotations

from absl import app, flags
import jax

from benchmarks.bench_model import PRESETS, bench_config, step_memory

_PRESET = flags.DEFINE_string("preset", "a3b8", "Model preset: " + ", ".join(PRESETS))
_BATCH = flags.DEFINE_integer("batch", 4, "Rows per step.")
_SEQ = flags.DEFINE_integer("seq", 1024, "Tokens per row (including one image's merged tokens).")
_BLOCK = flags.DEFINE_integer("attention_block", 64, "ModelConfig.attention_block (0: one full causal square).")
_VARIANTS = flags.DEFINE_list(
    "variants", ["dense:einsum:none", "dense:recompute:none", "blocked:einsum:none", "blocked:recompute:none",
                 "grouped:einsum:none", "grouped:recompute:none", "dense:einsum:full", "dense:recompute:full"],
    "moe_impl:attention_impl:remat triples.")

GIB = 2 ** 30


def main(argv):
  del argv
  rows = []
  for v in _VARIANTS.value:
    impl, attn, remat = v.split(":")
    cfg = bench_config(_PRESET.value, moe_impl=impl, attention_impl=attn, remat=remat, dtype="bfloat16",
                       attention_block=_BLOCK.value)
    rows.append((impl, attn, remat, step_memory(cfg, _BATCH.value, _SEQ.value)))
    print(f"[bench] {v}: {rows[-1][3]}", flush=True)
  print(f"\ntrain-step buffers (compiled, not run) on {jax.devices()[0].platform}; preset {_PRESET.value}, batch "
        f"{_BATCH.value} x {_SEQ.value}, bf16 compute, f32 params, scanned layers, attention_block {_BLOCK.value}; "
        f"jax {jax.__version__}")
  print(f"{'moe_impl':>8} {'attention':>9} {'remat':>5} {'temp GiB':>9} {'params+batch GiB':>16} "
        f"{'loss+grads GiB':>14} {'compile s':>9}")
  for impl, attn, remat, m in rows:
    print(f"{impl:>8} {attn:>9} {remat:>5} {m['temp'] / GIB:>9.2f} {m['args'] / GIB:>16.2f} {m['out'] / GIB:>14.2f} "
          f"{m['compile_s']:>9.0f}")


if __name__ == "__main__":
  app.run(main)
