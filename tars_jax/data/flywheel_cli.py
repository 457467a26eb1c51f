"""The flywheel driver's (experiments/flywheel.py) command-line forwarding and its per-iteration table:
the `--config.*` overrides it passes to its stages, and the table of one line per iteration."""

from __future__ import annotations

import os
import re


def forwarded_overrides(argv: list[str]) -> list[str]:
  """The `--config.<field>` overrides of a command line, as `--config.<field>=<value>` strings."""
  out, i = [], 0
  while i < len(argv):
    a = argv[i]
    if a.startswith("--config."):
      if "=" in a:
        out.append(a)
      elif i + 1 < len(argv):
        out.append(f"{a}={argv[i + 1]}")
        i += 1
    i += 1
  return out


def config_spec(spec: str) -> str:
  """`path.py[:arg]` with the path made absolute (stages run from the repository root)."""
  m = re.fullmatch(r"(.*?\.py)(:.*)?", spec)
  return os.path.abspath(m.group(1)) + (m.group(2) or "") if m else spec


def pct(x) -> str:
  return "-" if x is None else f"{x:.3f}"


def format_table(rows: list[dict], tasks: list[str]) -> str:
  """The flywheel table: a line per iteration (samples, verdicts, V = 1 fraction, set sizes after the
  iteration, stages, held-out success per task)."""
  short = [t.split("/")[-1] for t in tasks]
  head = (f"{'iter':>4s} {'samples':>7s} {'V=1':>5s} {'V=0':>5s} {'lost':>4s} {'V=1 frac':>8s} {'SFT set':>7s} "
          f"{'CT set':>6s}  {'stages':26s}" + "".join(f" {s[:14]:>14s}" for s in short))
  lines = [head, "-" * len(head)]
  for r in rows:
    if r["iteration"] == 0:
      lines.append(f"{0:4d} {'':7s} {'':5s} {'':5s} {'':4s} {'':8s} {'':7s} {'':6s}  {'initial policy':26s}"
                   + "".join(f" {pct(r['heldout'].get(t)):>14s}" for t in tasks))
      continue
    lines.append(f"{r['iteration']:4d} {r['generated']:7d} {r['v1']:5d} {r['v0']:5d} {r['lost']:4d} "
                 f"{pct(r['v1_fraction']):>8s} {r['sft_set']:7d} {r['ct_set']:6d}  {','.join(r['stages']):26s}"
                 + "".join(f" {pct(r.get('heldout', {}).get(t)):>14s}" for t in tasks))
  return "\n".join(lines)
