"""The command line a benchmark reports beside its table, as it was really run."""

from __future__ import annotations

import os


def command_line(module: str, flags: str) -> str:
  """`[nice -n N ].venv/bin/python -m <module> <flags>`: the `nice` prefix only when this process
  runs at niceness N > 0 (read with `os.nice(0)`), so a reported command says how it was run."""
  n = os.nice(0)
  return f"{f'nice -n {n} ' if n > 0 else ''}.venv/bin/python -m {module} {flags}"
