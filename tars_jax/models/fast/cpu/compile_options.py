"""Per-executable XLA options: the decode loop compiled without XLA:CPU's YNNPACK fusions.

XLA:CPU (jaxlib 0.10.2) hands dots and some elementwise / reduce fusions to YNNPACK by default
(`xla_cpu_experimental_ynn_fusion_type`). That speeds up the train step but slows the sampler's
decode loop, whose dots have 1-16 rows against weight matrices read once per step (same tokens either
way; `benchmarks/RESULTS.md`, "YNNPACK off in the decode loop"). Options go to one `jax.jit` each, so the
train step keeps its default: a process-wide `XLA_FLAGS` cannot make that split.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

# An empty list of fusion types: no YNNPACK fusions at all (dots go to XLA's own Eigen kernels).
DECODE_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def jit_per_backend(fn: Callable, *, cpu_options: dict[str, Any], **jit_kwargs) -> Callable:
  """`jax.jit(fn, **jit_kwargs)`, compiled with `cpu_options` added when the default backend is CPU.

  The backend is read at each call (`jax.default_backend()`), so one import serves CPU tests and GPU
  runs; on other backends `fn` compiles with XLA's defaults (CPU-only fields are not set there).
  Each of the two jitted functions keeps its own compile cache.
  """
  plain = jax.jit(fn, **jit_kwargs)
  cpu = jax.jit(fn, compiler_options=cpu_options, **jit_kwargs)

  def call(*args, **kwargs):
    return (cpu if jax.default_backend() == "cpu" else plain)(*args, **kwargs)

  call.plain, call.cpu = plain, cpu
  call.__doc__, call.__wrapped__ = fn.__doc__, fn
  return call
