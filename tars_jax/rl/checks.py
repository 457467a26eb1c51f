"""Host-side input checks for the RL math (the pure functions stay jittable and do not check).

The trainer calls `check_finite` on rollout rewards, critic values and episode scores before they
enter GAE / the losses: one NaN would otherwise spread through whitening into every advantage.
"""

from __future__ import annotations

import numpy as np

from tars_jax.distributed import to_host


class NonFiniteError(ValueError):
  """An array that must be finite holds NaN or inf; `.positions` lists (index tuple, value) pairs."""

  def __init__(self, name: str, positions: list[tuple[tuple[int, ...], float]], count: int):
    self.name, self.positions, self.count = name, positions, count
    shown = ", ".join(f"{name}[{','.join(map(str, i))}]={v}" for i, v in positions)
    more = f" (and {count - len(positions)} more)" if count > len(positions) else ""
    super().__init__(f"{count} non-finite value(s) in {name}: {shown}{more}")


def check_finite(max_shown: int = 8, **arrays) -> None:
  """Raises NonFiniteError naming the first `max_shown` NaN/inf positions of each named array.

  Args:
    **arrays: name -> array-like (numpy or jax; copied to host; an array over several processes
      is gathered, `distributed.to_host`: every process must then call this). Checked in the order given.
  Example: `check_finite(rewards=batch["rewards"], values=values)` ->
    NonFiniteError("1 non-finite value(s) in rewards: rewards[0,3]=nan").
  """
  for name, x in arrays.items():
    a = to_host(x)  # numpy, jax, or a jax array spread over several processes (gathered)
    if not np.issubdtype(a.dtype, np.floating):
      continue
    bad = ~np.isfinite(a)
    if bad.any():
      idx = np.argwhere(bad)
      pos = [(tuple(int(k) for k in i), float(a[tuple(i)])) for i in idx[:max_shown]]
      raise NonFiniteError(name, pos, int(bad.sum()))
