r"""Learning-curve plot of a run: success rate and reward per iteration (PNG).

  python -m experiments.plot --run runs/miniwob_ppo [--out runs/miniwob_ppo/learning_curve.png]
"""

from __future__ import annotations

import os

from absl import app, flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tars_jax.train.metrics import read_metrics  # noqa: E402

_RUN = flags.DEFINE_string("run", None, "Run directory.")
_OUT = flags.DEFINE_string("out", None, "Output PNG (default <run>/learning_curve.png).")


def smooth(y: np.ndarray, k: int = 5) -> np.ndarray:
  """Trailing moving average over k points (shorter at the start)."""
  c = np.cumsum(np.insert(y, 0, 0.0))
  return np.array([(c[i + 1] - c[max(0, i + 1 - k)]) / (i + 1 - max(0, i + 1 - k)) for i in range(len(y))])


def plot_run(run: str, out: str) -> str:
  rows = read_metrics(run)
  if not rows:
    raise FileNotFoundError(f"no metrics.jsonl rows in {run}")
  ep = np.array([r.get("episodes_total", r["step"]) for r in rows])
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  keys = sorted({k for r in rows for k in r if k.startswith("success/")})
  for k in keys or ["success_rate"]:
    y = np.array([r.get(k, np.nan) for r in rows])
    axes[0].plot(ep, smooth(y), label=k.removeprefix("success/"))
  axes[0].set(title="training success rate (5-iter avg)", xlabel="episodes", ylim=(-0.02, 1.02))
  axes[0].legend()
  axes[1].plot(ep, smooth(np.array([r["reward"] for r in rows])), label="env reward")
  axes[1].plot(ep, smooth(np.array([r.get("train/explained_variance", np.nan) for r in rows])),
               label="value explained var.")
  axes[1].set(title="reward / critic", xlabel="episodes")
  axes[1].legend()
  axes[2].plot(ep, [r.get("train/entropy", np.nan) for r in rows], label="entropy (nats/token)")
  axes[2].plot(ep, [r.get("train/approx_kl", np.nan) for r in rows], label="approx KL")
  axes[2].plot(ep, [r.get("train/clipfrac", np.nan) for r in rows], label="clip fraction")
  axes[2].set(title="policy", xlabel="episodes")
  axes[2].legend()
  fig.suptitle(os.path.basename(os.path.normpath(run)))
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  return out


def main(argv):
  del argv
  out = plot_run(_RUN.value, _OUT.value or os.path.join(_RUN.value, "learning_curve.png"))
  print(f"[plot] wrote {out}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["run"])
  app.run(main)
