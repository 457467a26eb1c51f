"""Step-budget scaling (UI-TARS-2 report section 3, inference-time scaling with the step budget): the
same held-out jobs played once per budget (maximum turns per episode), the results as a table, JSON
and a plot. `experiments/eval.py --max_turns 2,4,8,16` is the command line."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from tars_jax.agent.trajectory import Episode
from tars_jax.rollout.agent_loop import ActFn
from tars_jax.rollout.episode import LoopConfig
from tars_jax.rollout.evaluation import play, play_sessions


def parse_budgets(values: Sequence[str | int] | None) -> list[int] | None:
  """Step budgets (turns per episode) from `--max_turns` values, in the given order; None for none.
  Raises: ValueError naming the value when one is not an int, is < 1, or repeats another."""
  if not values:
    return None
  out: list[int] = []
  for v in values:
    try:
      b = int(str(v).strip())
    except ValueError:
      raise ValueError(f"--max_turns: {v!r} is not an int (turns per episode)") from None
    if b < 1:
      raise ValueError(f"--max_turns: {v!r} is not a positive number of turns")
    if b in out:
      raise ValueError(f"--max_turns: {v!r} is given twice")
    out.append(b)
  return out


def budget_loop_cfgs(loop_cfg: LoopConfig, budgets: Sequence[int]) -> dict[int, LoopConfig]:
  """{budget: `loop_cfg` with max_turns = budget (turns per episode)}: copies made with
  `dataclasses.replace`, `loop_cfg` itself is left as it is (report section 3, step-budget scaling).
  Raises: ValueError for a budget that is not a positive int."""
  for b in budgets:
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
      raise ValueError(f"step budget {b!r} is not a positive int (turns per episode)")
  return {b: dataclasses.replace(loop_cfg, max_turns=b) for b in budgets}


def play_budgets(loop, act_for: Callable[[int], ActFn] | None, clients, jobs: Sequence[tuple[str, int]],
                 loop_cfg: LoopConfig, tok, budgets: Sequence[int], sessions: int, version: int,
                 progress: str | None = None, service=None) -> dict[int, list[Episode]]:
  """{budget: the episodes of `jobs`}: every (task, seed) of `jobs` played once per step budget
  (turns per episode; loop configs from `budget_loop_cfgs`), the same seeds at every budget, budgets
  in the given order. Through `evaluation.play` with `act_for(budget)`, the policy's act for that
  budget (a fresh sampler: the same keys at every budget; image slots for `budget` screenshots); or,
  with `service` (an inference service, `act_for` unused), through `evaluation.play_sessions`: each
  episode one session there (multi-turn KV reuse; the service's own keys).
  Raises: as `budget_loop_cfgs` and `evaluation.play` / `play_sessions`."""
  cfgs = budget_loop_cfgs(loop_cfg, budgets)
  out = {}
  for b, cfg in cfgs.items():
    bar = progress and (f"{progress} max_turns={b}" if len(cfgs) > 1 else progress)
    if service is not None:
      out[b] = play_sessions(loop, service, clients, jobs, cfg, tok, sessions=sessions, version=version, progress=bar)
    else:
      out[b] = play(loop, act_for(b), clients, jobs, cfg, tok, sessions=sessions, version=version, progress=bar)
  return out


def format_budget_table(summaries: dict[int, dict]) -> str:
  """Plain-text table of `evaluate_budgets` summaries: one row per task, one column per step budget
  (turns), each cell `success (mean steps)`."""
  budgets = list(summaries)
  tasks = sorted({t for s in summaries.values() for t in s})
  head = f"{'task':32s}" + "".join(f" {f'max_turns={b}':>16s}" for b in budgets)
  rows = ["success (mean steps) by step budget", head, "-" * len(head)]
  for t in tasks:
    cells = []
    for b in budgets:
      r = summaries[b].get(t)
      cell = "-" if r is None else f"{r['success']:.3f} ({r['mean_steps']:.2f})"
      cells.append(f" {cell:>16s}")
    rows.append(f"{t:32s}" + "".join(cells))
  return "\n".join(rows)


def budgets_json(step: int, summaries: dict[int, dict]) -> dict:
  """The `--json` of several budgets: {"checkpoint": step, "budgets": {"<budget>": {task: summary}}}."""
  return {"checkpoint": step, "budgets": {str(b): s for b, s in summaries.items()}}


def plot_budgets(summaries: dict[int, dict], out: str, title: str = "") -> str:
  """PNG `out` of success against step budget (turns per episode, log2 x-axis), one line per task
  (report section 3, inference-time scaling with the step budget); returns `out`.
  Raises: ValueError for no budgets."""
  if not summaries:
    raise ValueError("no step budgets to plot")
  import matplotlib  # here, not at the top: single-budget runs need no plotting
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  budgets = sorted(summaries)
  tasks = sorted({t for s in summaries.values() for t in s})
  fig, ax = plt.subplots(figsize=(6, 4))
  for t in tasks:
    ax.plot(budgets, [summaries[b].get(t, {}).get("success", float("nan")) for b in budgets], "o-", label=t)
  ax.set_xscale("log", base=2)
  ax.set_xticks(budgets, [str(b) for b in budgets])
  ax.set(xlabel="step budget (max turns per episode)", ylabel="held-out success", ylim=(-0.02, 1.02),
         title=title or "success against step budget")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out
