r"""Learning-curve plot of a run: success rate and reward per iteration, and a row of exploration
panels (entropy per free decision, informative fraction, distinct clicks per screen) (PNG); or
several runs' per-task success side by side (ablations).

  python -m experiments.plot --run runs/miniwob_ppo [--out runs/miniwob_ppo/learning_curve.png]
  python -m experiments.plot --compare runs/ppo,runs/grpo --out docs/ppo_vs_grpo.png
  python -m experiments.plot --pipeline runs/main [--out runs/main/pipeline.png]   # scripts/demo.sh
  python -m experiments.plot --flywheel runs/flywheel [--out runs/flywheel/flywheel.png]   # experiments/flywheel.py
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tars_jax.analysis.run_data import smooth  # noqa: E402
from tars_jax.train.metrics import read_metrics  # noqa: E402

_RUN = flags.DEFINE_string("run", None, "Run directory.")
_OUT = flags.DEFINE_string("out", None, "Output PNG (default <run>/learning_curve.png).")
_COMPARE = flags.DEFINE_list("compare", None, "Run directories to compare (per-task success).")
_PIPELINE = flags.DEFINE_string("pipeline", None, "Pipeline run dir of scripts/demo.sh (all its stages).")
_FLYWHEEL = flags.DEFINE_string("flywheel", None, "Run dir of experiments/flywheel.py (its flywheel.json).")


# Exploration panels (second row of `plot_run`), against iteration: (title, ((metric, label), ...)).
# Raw values, not smoothed, so a collapse onto one fixed click shows in the iteration it happens.
EXPLORE_PANELS = (
    ("entropy per free decision (nats)", (("explore/entropy_free", "sampled (rollout)"),
                                          ("train/entropy", "update (mean over steps)"))),
    ("informative fraction of episodes", (("train/informative_fraction", "informative episodes"),)),
    ("distinct first clicks per screen", (("explore/distinct_clicks_per_screen", "distinct clicks"),)),
)


def run_figure(rows: list[dict], title: str = "") -> plt.Figure:
  """Figure of a run's metrics rows (`read_metrics`): 2 x 3 axes.

  Row 1, against episodes: training success per task, reward / baseline quality, policy statistics.
  Row 2, against iteration (`step`), one panel per `EXPLORE_PANELS` entry, one line per metric
  (NaN where a row lacks it; a metric no row has is not drawn): entropy per free decision,
  informative fraction, distinct clicks per screen. Collapse looks like all three falling together
  (entropy to 0, informative fraction to 0, distinct clicks to 1).
  Raises: ValueError for no rows.
  """
  if not rows:
    raise ValueError("no metrics rows to plot")
  ep = np.array([r.get("episodes_total", r["step"]) for r in rows])
  fig, axes = plt.subplots(2, 3, figsize=(15, 8))
  keys = sorted({k for r in rows for k in r if k.startswith("success/")})
  for k in keys or ["success_rate"]:
    y = np.array([r.get(k, np.nan) for r in rows])
    axes[0, 0].plot(ep, smooth(y), label=k.removeprefix("success/"))
  axes[0, 0].set(title="training success rate (5-iter avg)", xlabel="episodes", ylim=(-0.02, 1.02))
  axes[0, 0].legend()
  axes[0, 1].plot(ep, smooth(np.array([r["reward"] for r in rows])), label="env reward")
  if any("train/explained_variance" in r for r in rows):  # PPO: how well the critic tracks returns
    axes[0, 1].plot(ep, smooth(np.array([r.get("train/explained_variance", np.nan) for r in rows])),
                    label="value explained var.")
  axes[0, 1].set(title="reward / baseline", xlabel="episodes")
  axes[0, 1].legend()
  axes[0, 2].plot(ep, [r.get("train/entropy", np.nan) for r in rows], label="entropy (nats/decision)")
  axes[0, 2].plot(ep, [r.get("train/approx_kl", np.nan) for r in rows], label="approx KL")
  axes[0, 2].plot(ep, [r.get("train/clipfrac", np.nan) for r in rows], label="clip fraction")
  axes[0, 2].set(title="policy", xlabel="episodes")
  axes[0, 2].legend()
  it = np.array([r["step"] for r in rows])
  for ax, (panel, metrics) in zip(axes[1], EXPLORE_PANELS):
    for key, label in metrics:
      if any(key in r for r in rows):
        ax.plot(it, [r.get(key, np.nan) for r in rows], label=label, marker="o" if len(rows) < 30 else None)
    ax.set(title=panel, xlabel="iteration")
    if ax.lines:
      ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  return fig


def plot_run(run: str, out: str) -> str:
  """`run_figure` of `<run>/metrics.jsonl` saved as PNG `out`; returns `out`.
  Raises: FileNotFoundError if the run has no metrics rows."""
  rows = read_metrics(run)
  if not rows:
    raise FileNotFoundError(f"no metrics.jsonl rows in {run}")
  fig = run_figure(rows, os.path.basename(os.path.normpath(run)))
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def plot_compare(runs: list[str], out: str) -> str:
  """One panel per task: smoothed training success vs episodes for each run. Raises
  FileNotFoundError if a run has no metrics."""
  data = {}
  for run in runs:
    rows = read_metrics(run)
    if not rows:
      raise FileNotFoundError(f"no metrics.jsonl rows in {run}")
    data[run] = rows
  tasks = sorted({k for rows in data.values() for r in rows for k in r if k.startswith("success/")})
  fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(6 * max(1, len(tasks)), 4), squeeze=False)
  for ax, k in zip(axes[0], tasks):
    for run, rows in data.items():
      ep = np.array([r.get("episodes_total", r["step"]) for r in rows])
      ax.plot(ep, smooth(np.array([r.get(k, np.nan) for r in rows]), 10), label=os.path.basename(run))
    ax.set(title=f"{k.removeprefix('success/')} (training success, 10-iter avg)", xlabel="episodes",
           ylim=(-0.02, 1.02))
    ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  return out


REPLICATION_PANELS = (("eval/success", "held-out success (mean over tasks)"), ("success_rate", "training success"),
                      ("explore/entropy_free", "entropy per free decision (nats)"),
                      ("train/explained_variance", "value explained variance"),
                      ("train/value_return_corr", "corr(value, return)"), ("think_tokens", "think tokens per turn"))


def plot_replication(workdir: str, runs: list[str], out: str) -> str | None:
  """Curves of the replication suite (experiments/replicate.py): per variant, mean +- std over its
  seeds at the iterations every seed logged, of each REPLICATION_PANELS metric some run logged;
  "eval/success" is the mean over tasks of the in-training held-out evaluation. `runs`: names
  "<variant>/seed_<s>" under `workdir` (those without metrics yet are left out). Returns `out`, or None
  when no run has metrics."""
  by_variant: dict[str, list[list[dict]]] = {}
  for name in runs:
    rows = read_metrics(os.path.join(workdir, name))
    for r in rows:
      ev = [v for k, v in r.items() if k.startswith("eval/") and k.endswith("/success")]
      if ev:
        r["eval/success"] = float(np.mean(ev))
    if rows:
      by_variant.setdefault(name.split("/")[0], []).append(rows)
  panels = [(k, t) for k, t in REPLICATION_PANELS
            if any(k in r for rs in by_variant.values() for rows in rs for r in rows)]
  if not panels:
    return None
  fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
  for ax, (key, title) in zip(axes[0], panels):
    for ci, (variant, rs) in enumerate(sorted(by_variant.items())):
      per_x: dict[int, list[float]] = {}
      for rows in rs:
        for r in rows:
          if key in r:
            per_x.setdefault(int(r.get("episodes_total", r["step"])), []).append(float(r[key]))
      xs = sorted(x for x, v in per_x.items() if len(v) == len(rs))
      if not xs:
        continue
      ys = np.array([per_x[x] for x in xs])
      mean, std = ys.mean(1), ys.std(1)
      ax.plot(xs, mean, label=f"{variant} ({len(rs)})", color=f"C{ci}", marker="o" if len(xs) < 8 else None)
      ax.fill_between(xs, mean - std, mean + std, alpha=0.2, color=f"C{ci}")
    ax.set(title=title, xlabel="training episodes")
  axes[0][0].legend(fontsize=8)
  fig.suptitle("replication suite: mean +- std over training seeds")
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def _series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of the rows that have `key`."""
  xs = [(r["step"], r[key]) for r in rows if key in r]
  return np.array([x for x, _ in xs]), np.array([y for _, y in xs])


def pipeline_figure(run: str) -> plt.Figure:
  """One figure of a pipeline run dir (scripts/demo.sh: <run>/{grounding,sft,vpt,ppo}, eval_*.json):
  supervised stages' train / held-out cross-entropy and grounding accuracy, sandbox success during SFT
  and RL, the RL stage's exploration, and the held-out evaluation of the SFT vs the RL policy.
  Stages that have not run are left empty. Raises FileNotFoundError when no stage has metrics."""
  stages = {s: read_metrics(os.path.join(run, s)) for s in ("grounding", "sft", "vpt", "ppo")}
  if not any(stages.values()):
    raise FileNotFoundError(f"no stage of {run} has metrics.jsonl rows")
  fig, axes = plt.subplots(2, 3, figsize=(16, 8))
  ax = axes[0, 0]
  for stage in ("grounding", "sft"):
    # scripts/demo.sh gives both stages the grounding examples' held-out split (sft.heldout)
    for key, style, what in (("train/ce", "-", "train (its records)"),
                             ("heldout/ce", "o--", "held-out grounding examples")):
      x, y = _series(stages[stage], key)
      if len(x):
        ax.plot(x, smooth(y, 10) if style == "-" else y, style, label=f"{stage}: {what}")
  ax.set(title="supervised stages: cross-entropy (nats / reply token)", xlabel="step", yscale="log")
  ax = axes[0, 1]
  for stage in ("grounding", "sft"):
    for key in ("grounding/where_hit", "grounding/what_exact"):
      x, y = _series(stages[stage], key)
      if len(x):
        ax.plot(x, y, "o-", label=f"{stage}: {key.split('/')[1]}")
  ax.set(title="held-out grounding accuracy (sampled)", xlabel="step", ylim=(-0.02, 1.02))
  ax = axes[0, 2]
  # the RL rollouts' success (training seeds) always; held-out evaluations where the config ran them
  x, y = _series(stages["ppo"], "success_rate")
  if len(x):
    ax.plot(x, smooth(y), "-", label="ppo: rollouts (training seeds)")
  for stage, marker in (("sft", "o-"), ("ppo", "s-")):
    for key in sorted({k for r in stages[stage] for k in r if k.startswith("eval/") and k.endswith("/success")}):
      x, y = _series(stages[stage], key)
      ax.plot(x, y, marker, label=f"{stage}: held-out {key.split('/')[2]}")
  ax.set(title="success during training (sampled)", xlabel="step / iteration", ylim=(-0.02, 1.02))
  ax = axes[1, 0]
  for key, label in (("train/value_loss", "value loss"), ("train/explained_variance", "explained var.")):
    x, y = _series(stages["vpt"], key)
    if len(x):
      ax.plot(x, y, "o-", label=f"vpt {label}")
    x, y = _series(stages["ppo"], key)
    if len(x):
      ax.plot(x, smooth(y), label=f"ppo {label}")
  # A batch of near-constant returns (every episode a success) has a variance near 0, so its explained
  # variance can reach -1e6 and flatten every other line: the axis stops at -1.
  ax.set(title="critic: value pretraining, then PPO (axis from -1)", xlabel="iteration")
  ys = np.concatenate([np.asarray(line.get_ydata(), float) for line in ax.lines] or [np.zeros(1)])
  ax.set_ylim(-1.0, max(1.05, float(np.nanmax(ys, initial=0.0)) * 1.05))
  ax = axes[1, 1]
  for key, label in (("explore/entropy_free", "entropy / free decision"),
                     ("train/informative_fraction", "informative fraction"),
                     ("explore/distinct_clicks_per_screen", "distinct clicks / screen")):
    x, y = _series(stages["ppo"], key)
    if len(x):
      ax.plot(x, smooth(y), label=label)
  ax.set(title="RL stage: exploration", xlabel="iteration")
  ax = axes[1, 2]
  evals = {}
  for stage in ("sft", "ppo"):
    path = os.path.join(run, f"eval_{stage}.json")
    if os.path.exists(path):
      with open(path) as f:
        evals[stage] = json.load(f)["results"]
  tasks = sorted({t for e in evals.values() for t in e})
  for i, (stage, res) in enumerate(evals.items()):
    ys = [res.get(t, {}).get("success", np.nan) for t in tasks]
    bars = ax.bar(np.arange(len(tasks)) + 0.4 * i, ys, 0.4, label={"sft": "SFT", "ppo": "SFT + RL"}[stage])
    ax.bar_label(bars, fmt="%.2f")
  ax.set_xticks(np.arange(len(tasks)) + 0.2, [t.split("/")[-1] for t in tasks])
  ax.set(title="held-out evaluation (200 seeds, sampled)", ylim=(0, 1.1))
  for a in axes.flat:
    if a.lines or a.patches:
      a.legend(fontsize=8)
  fig.suptitle(f"pipeline {os.path.basename(os.path.normpath(run))}: grounding -> SFT -> value pretraining -> PPO")
  fig.tight_layout()
  return fig


def flywheel_figure(rows: list[dict], tasks: list[str], title: str = "") -> plt.Figure:
  """Figure of the flywheel table (experiments/flywheel.py, flywheel.json "rows"), against iteration:
  the fraction of samples with V = 1 (all tasks and per task; iteration t's samples come from iteration
  t-1's policy), held-out success per task of each iteration's policy (iteration 0 = the initial policy,
  when measured), and the SFT / CT set sizes after each iteration. Raises ValueError for no rows."""
  if not rows:
    raise ValueError("no flywheel rows to plot")
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  gen = [r for r in rows if r["iteration"] >= 1]

  def y(values):
    return np.array([np.nan if v is None else v for v in values], float)

  ax = axes[0]
  if gen:
    x = [r["iteration"] for r in gen]
    ax.plot(x, y([r["v1_fraction"] for r in gen]), "o-", lw=2, color="k", label="all tasks")
    for t in tasks:
      ax.plot(x, y([r["per_task"].get(t, {}).get("v1_fraction") for r in gen]), "o--", label=t.split("/")[-1])
  ax.set(title="samples with V = 1 (rejection sampling)", xlabel="iteration t (sampled by the policy of t - 1)",
         ylim=(-0.02, 1.02))
  ax = axes[1]
  ev = [r for r in rows if "heldout" in r]
  for t in tasks:
    ax.plot([r["iteration"] for r in ev], y([r["heldout"].get(t) for r in ev]), "s-", label=t.split("/")[-1])
  ax.set(title="held-out success of the iteration's policy", xlabel="iteration t (its RL policy; 0 = the initial one)",
         ylim=(-0.02, 1.02))
  ax = axes[2]
  if gen:
    x = [r["iteration"] for r in gen]
    ax.plot(x, [r["sft_set"] for r in gen], "o-", label="SFT set (V = 1, with its base)")
    ax.plot(x, [r["ct_set"] for r in gen], "o-", label="CT set (V = 0, with its base)")
  ax.set(title="data set sizes after the iteration (records)", xlabel="iteration")
  for a in axes:
    a.xaxis.get_major_locator().set_params(integer=True)
    if a.lines:
      a.legend(fontsize=8)
  fig.suptitle(title or "data flywheel: generate -> validate -> route -> CT / SFT -> RL")
  fig.tight_layout()
  return fig


def flywheel_plot(run: str, out: str | None = None) -> str:
  """`flywheel_figure` of `<run>/flywheel.json`, saved to `out` (default <run>/flywheel.png); returns the
  path. Raises FileNotFoundError without flywheel.json."""
  with open(os.path.join(run, "flywheel.json")) as f:
    data = json.load(f)
  out = out or os.path.join(run, "flywheel.png")
  fig = flywheel_figure(data["rows"], data["tasks"], f"data flywheel {os.path.basename(os.path.normpath(run))}")
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def main(argv):
  del argv
  if _FLYWHEEL.value:
    print(f"[plot] wrote {flywheel_plot(_FLYWHEEL.value, _OUT.value)}")
    return
  if _PIPELINE.value:
    out = _OUT.value or os.path.join(_PIPELINE.value, "pipeline.png")
    fig = pipeline_figure(_PIPELINE.value)
    fig.savefig(out, dpi=100)
    print(f"[plot] wrote {out}")
    return
  if _COMPARE.value:
    if not _OUT.value:
      raise app.UsageError("--compare needs --out")
    print(f"[plot] wrote {plot_compare(_COMPARE.value, _OUT.value)}")
    return
  if not _RUN.value:
    raise app.UsageError("--run or --compare is required")
  out = plot_run(_RUN.value, _OUT.value or os.path.join(_RUN.value, "learning_curve.png"))
  print(f"[plot] wrote {out}")


if __name__ == "__main__":
  app.run(main)
