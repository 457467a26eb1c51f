r"""Merge vertical agents by parameter interpolation (report section 2.6): θ = Σ α_k θ_k over Orbax
checkpoints, or task arithmetic θ_base + Σ λ_k (θ_k − θ_base) from their shared SFT start.

  python -m experiments.merge --ckpt runs/browse/ppo --ckpt runs/game/ppo --alpha 0.5,0.5 --out runs/merged
  python -m experiments.merge --base runs/main/sft --ckpt runs/browse/ppo --ckpt runs/game/ppo \
      --lambdas 0.7,0.7 --out runs/merged_ta
  python -m experiments.eval --run runs/merged --tasks miniwob/click-test --episodes 200

A checkpoint is a run dir (its latest step; a pipeline run dir means its newest stage), a step dir
`<run>/checkpoints/<step>`, or any Orbax PyTree dir (`StandardCheckpointer`); the output is of the same
kind: a run dir that experiments/eval.py and `--config.policy.init` read, or a PyTree dir. Optimiser
state is reset to a fresh one unless `--optimizer` says otherwise (tars_jax/merge.py says why).
Checkpoints of different structure or model config, or (without --allow_different_starts) of runs trained
from different initial policies (config `policy.init`), are refused before anything is written.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags

from tars_jax import merge

_CKPT = flags.DEFINE_multi_string("ckpt", [], "A checkpoint to merge (repeat the flag for each).")
_ALPHA = flags.DEFINE_list("alpha", None, "Interpolation weights, one per --ckpt, summing to 1 "
                           "(default: uniform).")
_BASE = flags.DEFINE_string("base", None, "Task arithmetic: the checkpoint the --ckpt runs started from.")
_LAMBDAS = flags.DEFINE_list("lambdas", None, "Task arithmetic: one scale per --ckpt task vector (with --base).")
_OUT = flags.DEFINE_string("out", None, "Output directory (new or empty).", required=True)
_UNNORM = flags.DEFINE_bool("allow_unnormalised", False, "Accept --alpha that does not sum to 1.")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "reset", merge.OPTIMIZERS, "Optimiser-state leaves: reset to a "
                               "fresh state, copy from the first --ckpt, or merge like the parameters.")
_CHUNK_MB = flags.DEFINE_integer("chunk_mb", 128, "Most MiB read per Orbax restore (peak memory ~ one model "
                                 "+ 3 x this).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out.")
_STARTS = flags.DEFINE_bool("allow_different_starts", False, "Merge runs trained from different initial "
                            "policies (refused by default, naming the two starts).")


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.WARNING)  # no Orbax info lines around the summary
  ckpts, chunk = _CKPT.value, _CHUNK_MB.value << 20
  if not ckpts:
    raise app.UsageError("give the checkpoints to merge: --ckpt A --ckpt B ...")
  try:
    r, formula = _run(ckpts, chunk)
  except (merge.MergeError, FileNotFoundError, FileExistsError) as e:  # bad input: the reason, no traceback
    sys.exit(f"[merge] {type(e).__name__}: {e}")
  use = (f"evaluate: python -m experiments.eval --run {r.out_dir}" if r.kind == "trainer" else
         "restore: train.checkpoint.restore_tree(path, target) / orbax StandardCheckpointer")
  print(f"[merge] θ = {formula} over {len(ckpts)} checkpoints -> {r.checkpoint} ({r.merged} leaves merged, "
        f"{r.copied} copied, {r.reset} reset; {r.nbytes / 2**20:.1f} MiB); {use}")


def _run(ckpts: list[str], chunk: int) -> tuple[merge.MergeResult, str]:
  if _BASE.value is not None:
    if _LAMBDAS.value is None or _ALPHA.value is not None:
      raise app.UsageError("--base takes --lambdas (one per --ckpt), not --alpha")
    lambdas = [float(x) for x in _LAMBDAS.value]
    r = merge.task_arithmetic(_BASE.value, ckpts, lambdas, _OUT.value, optimizer=_OPTIMIZER.value,
                              chunk_bytes=chunk, overwrite=_OVERWRITE.value,
                              allow_different_starts=_STARTS.value)
    formula = "θ_base + " + " + ".join(f"{w:g}·(θ{k} − θ_base)" for k, w in enumerate(lambdas, 1))
  else:
    if _LAMBDAS.value is not None:
      raise app.UsageError("--lambdas needs --base (task arithmetic); interpolation takes --alpha")
    alphas = [float(x) for x in _ALPHA.value] if _ALPHA.value else [1.0 / len(ckpts)] * len(ckpts)
    r = merge.interpolate(ckpts, alphas, _OUT.value, allow_unnormalised=_UNNORM.value,
                          optimizer=_OPTIMIZER.value, chunk_bytes=chunk, overwrite=_OVERWRITE.value,
                          allow_different_starts=_STARTS.value)
    formula = " + ".join(f"{w:g}·θ{k}" for k, w in enumerate(alphas, 1))
  return r, formula


if __name__ == "__main__":
  app.run(main)
