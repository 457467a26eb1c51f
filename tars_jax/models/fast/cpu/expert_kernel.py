"""CPU kernels for the MoE experts (XLA FFI custom calls): the decode step over tile-packed weights,
and the grouped SwiGLU of the train step (forward and backward) on OpenBLAS.

Decode (`swiglu_experts`):
At decode an expert sees 0-16 rows, so its SwiGLU is bound by streaming the expert's weights from
memory. XLA:CPU's Eigen dots read them well below memory bandwidth there, and no XLA option changed
that (`benchmarks/RESULTS.md`, "Decode overflow without the dense path ...": tried, no gain).
`csrc/decode_experts.cc` instead keeps a 4-row x 64-byte block of outputs in vector registers,
reads each expert's weights once, front to back, from a copy packed in 64-byte column tiles, and
shares the (expert, tile) work between the calling thread and XLA's intra-op thread pool, so all
cores stream weights (RESULTS.md, "Decode experts as an FFI kernel"). Dropless and exact per expert like
the other MoE paths: only the rows really routed to an expert are computed (no capacity, no overflow
branch).

Train step (`grouped_swiglu`, a `jax.custom_vjp`): the "grouped" MoE path's experts, each expert's
group of rows as OpenBLAS sgemm calls (`csrc/grouped_swiglu.cc`; the `scipy-openblas32` wheel, the
BLAS numpy ships) with the SwiGLU and its derivative in C++ between them: one custom call forward,
one backward, instead of XLA:CPU's while loop over chunks (`grouped_mlp.py`), whose dots run the
benchmark model's MoE shapes slower than OpenBLAS's sgemm (RESULTS.md, "Train-step experts on
OpenBLAS").

The C++ sources are compiled on first use with the machine's g++ (`-O3 -march=native`, XLA FFI
headers from jaxlib) into `$TARS_JAX_KERNEL_DIR` (default `~/.cache/tars_jax/kernels`), keyed by a
hash of the sources, the flags, the jaxlib and OpenBLAS versions and the CPU's feature flags;
`scripts/setup.sh` builds it ahead (`expert_kernel.main()`). Where it cannot be built (no g++, no
scipy-openblas32), `available()` is False with the compiler's message in `build_error()`, and the MoE
layers keep their XLA paths.

Layouts (float32; `pack_gate_up`, `pack_down`):
  gate|up  [E, D, 2, I] (`MoE.w_gate_up`)  -> [E, I/8, D, 2, 8]: per expert and 8-column tile, for each
           input row d the 8 gate then the 8 up weights (one 64-byte line);
  down     [E, I, D]    (`MoE.w_down`)     -> [E, D/16, I, 16].
Source: the packing of GEMM micro-kernels (Goto & van de Geijn 2008, "Anatomy of high-performance
matrix multiplication"); the JAX FFI tutorial (docs.jax.dev, "Foreign function interface").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import jaxlib

GATE_UP_TILE = 8  # columns of gate (and of up) per packed tile: kGateUpTile in the C++ source
DOWN_TILE = 16  # columns of down per packed tile: kDownTile
SOURCES = tuple(pathlib.Path(__file__).parent / "csrc" / f for f in ("decode_experts.cc", "grouped_swiglu.cc"))
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
TARGETS = {"tars_moe_gate_up": "TarsMoeGateUp", "tars_moe_down": "TarsMoeDown",
           "tars_grouped_swiglu_fwd": "TarsGroupedSwigluFwd", "tars_grouped_swiglu_bwd": "TarsGroupedSwigluBwd"}


class KernelBuildError(RuntimeError):
  """The kernel's C++ source did not compile (message: the compiler's command and output)."""


def kernel_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("TARS_JAX_KERNEL_DIR", pathlib.Path.home() / ".cache" / "tars_jax" / "kernels"))


def _cpu_features() -> bytes:
  """The CPU's feature flags (Linux /proc/cpuinfo; else the processor name): `-march=native` code built
  on one CPU may not run on another, so a shared cache directory keeps one library per kind of CPU."""
  try:
    with open("/proc/cpuinfo") as f:
      return next((line for line in f if line.startswith("flags")), "").encode()
  except OSError:
    return platform.processor().encode()


def _blas_version() -> str:
  try:
    import scipy_openblas32
  except ImportError:
    return ""
  return scipy_openblas32.__version__


def _blas_flags() -> list[str]:
  """Include and link flags of the scipy-openblas32 wheel (its library found again at load time by rpath).
  Raises KernelBuildError when the wheel is missing."""
  try:
    import scipy_openblas32 as blas
  except ImportError as e:
    raise KernelBuildError(f"scipy-openblas32 is not installed (requirements.txt): {e}") from e
  lib = blas.get_lib_dir()
  return ["-I", blas.get_include_dir(), "-L", lib, f"-l{blas.get_library()}", f"-Wl,-rpath,{lib}"]


def library_path() -> pathlib.Path:
  """Where the shared library for this source, these flags, this jaxlib and this CPU lives (built or not)."""
  files = sorted(SOURCES[0].parent.glob("*.[ch]*"))  # the .cc sources and the headers they include
  key = hashlib.sha256(b"".join(f.read_bytes() for f in files) + " ".join(FLAGS).encode()
                       + jaxlib.__version__.encode() + _blas_version().encode() + _cpu_features()).hexdigest()
  return kernel_dir() / f"expert_kernels-{key[:16]}.so"


def build() -> pathlib.Path:
  """Compiles the `csrc/` sources into one library if these sources/flags/jaxlib/BLAS/CPU have none
  yet; returns its path.

  Raises KernelBuildError with the compiler's output when g++ is missing or fails. The library is
  written to a temporary name and renamed, so concurrent builds (pytest workers) never load a partial
  file.
  """
  out = library_path()
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_suffix(f".{os.getpid()}.tmp")
  cmd = ["g++", *FLAGS, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", str(tmp), *_blas_flags()]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True)
  except FileNotFoundError as e:
    raise KernelBuildError(f"{' '.join(cmd)}: {e}") from e
  if proc.returncode:
    tmp.unlink(missing_ok=True)
    raise KernelBuildError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
  os.replace(tmp, out)
  return out


@functools.cache
def _load() -> tuple[bool, str]:
  """Builds and registers the FFI targets once per process: (ok, error message)."""
  try:
    lib = ctypes.cdll.LoadLibrary(str(build()))
  except (KernelBuildError, OSError) as e:
    return False, str(e)
  for name, symbol in TARGETS.items():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  return True, ""


def _require() -> None:
  """Builds and registers the kernels (once), or raises KernelBuildError saying why they are not."""
  ok, err = _load()
  if not ok:
    raise KernelBuildError(err)


def available() -> bool:
  """True when the kernel is built and registered (compiles it on the first call, ~5 s)."""
  return _load()[0]


def build_error() -> str:
  """Why `available()` is False ('' when it is True)."""
  return _load()[1]


def supports(hidden: int, moe_intermediate: int, dtype) -> bool:
  """Whether a MoE layer's shapes and compute dtype fit the kernel: float32, D a multiple of 16, I of 8."""
  return (jnp.dtype(dtype) == jnp.float32 and hidden % DOWN_TILE == 0 and moe_intermediate % GATE_UP_TILE == 0)


def pack_gate_up(w_gate_up: jax.Array) -> jax.Array:
  """[E, D, 2, I] float32 (gate at index 0, up at 1) -> [E, I/8, D, 2, 8] (see the module docstring)."""
  e, d, two, i = w_gate_up.shape
  return w_gate_up.reshape(e, d, two, i // GATE_UP_TILE, GATE_UP_TILE).transpose(0, 3, 1, 2, 4)


def pack_down(w_down: jax.Array) -> jax.Array:
  """[E, I, D] float32 -> [E, D/16, I, 16]."""
  e, i, d = w_down.shape
  return w_down.reshape(e, i, d // DOWN_TILE, DOWN_TILE).transpose(0, 2, 1, 3)


def swiglu_experts(xs: jax.Array, sizes: jax.Array, gate_up_packed: jax.Array, down_packed: jax.Array) -> jax.Array:
  """Each expert's SwiGLU on its group of rows: xs [G, D] float32 sorted by expert (expert e owns the
  sizes[e] rows after experts < e; `moe.sort_by_expert`), sizes [E] int32, packed weights
  (`pack_gate_up`, `pack_down`) -> [G, D] float32 (rows past sum(sizes): 0). Equals
  `moe.ragged_swiglu` on the unpacked weights up to float32 rounding (per-row sums in another order).

  CPU only (XLA FFI custom calls). Not differentiable (decode only). Raises KernelBuildError (at
  trace time) when the kernels cannot be built (`available()` says so first), and at run time, from
  the kernel, if the shapes disagree or sizes sum past G.
  """
  _require()
  g = xs.shape[0]
  i = gate_up_packed.shape[1] * GATE_UP_TILE
  h = jax.ffi.ffi_call("tars_moe_gate_up", jax.ShapeDtypeStruct((g, i), jnp.float32))(xs, sizes, gate_up_packed)
  return jax.ffi.ffi_call("tars_moe_down", jax.ShapeDtypeStruct(xs.shape, jnp.float32))(h, sizes, down_packed)


def _grouped_call(name: str, outs, *args):
  _require()
  # "sequential": under vmap, one call per batch element (the kernels take one group list each).
  return jax.ffi.ffi_call(name, outs, vmap_method="sequential")(*args)


@jax.custom_vjp
def grouped_swiglu(xs: jax.Array, sizes: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """ys [G, D] = down(silu(x W_gate[e]) * (x W_up[e])) for each row x of expert e's group, on OpenBLAS.

  Args: xs [G, D] float32 sorted by expert (`moe.sort_by_expert`; expert e owns the sizes[e] rows after
    experts < e); sizes [E] int32; w_gate_up [E, D, 2, I] float32 (gate at [:, :, 0]: `MoE.w_gate_up`);
    w_down [E, I, D] float32.
  Returns ys [G, D] float32 (rows past sum(sizes): 0). Differentiable in xs and both weights (reverse
  mode, `jax.custom_vjp`); the forward keeps the gate|up pre-activations [G, 2I] for the backward, as
  `grouped_mlp.grouped_swiglu` does. Equals it (and `moe.ragged_swiglu`) up to float32 rounding.
  CPU only. Raises KernelBuildError (at trace time) when the kernels cannot be built, and at run time
  if the shapes disagree or sizes sum past G.
  Source: the "grouped" path's math (`grouped_mlp.py`); transformers `grouped_mm` experts.
  """
  return _grouped_fwd(xs, sizes, w_gate_up, w_down)[0]


def _grouped_fwd(xs, sizes, w_gate_up, w_down):
  e, d, _, i = w_gate_up.shape
  g = xs.shape[0]
  f32 = jnp.float32
  ys, ab = _grouped_call("tars_grouped_swiglu_fwd", (jax.ShapeDtypeStruct((g, d), f32), jax.ShapeDtypeStruct((g, 2 * i), f32)),
                         xs, sizes, w_gate_up.reshape(e, d, 2 * i), w_down)
  return ys, (xs, sizes, w_gate_up, w_down, ab)


def _grouped_bwd(res, dys):
  xs, sizes, w_gate_up, w_down, ab = res
  e, d, _, i = w_gate_up.shape
  dxs, dwgu, dwd = _grouped_call(
      "tars_grouped_swiglu_bwd",
      (jax.ShapeDtypeStruct(xs.shape, jnp.float32), jax.ShapeDtypeStruct((e, d, 2 * i), jnp.float32),
       jax.ShapeDtypeStruct(w_down.shape, jnp.float32)),
      xs, sizes, w_gate_up.reshape(e, d, 2 * i), w_down, ab, dys.astype(jnp.float32))
  return dxs, None, dwgu.reshape(w_gate_up.shape), dwd


grouped_swiglu.defvjp(_grouped_fwd, _grouped_bwd)


def main() -> int:
  """scripts/setup.sh: build ahead of the first decode; prints where the library is (exit 0) or why it
  is not (exit 1)."""
  if not available():
    print(f"[expert_kernel] not built, the MoE decode keeps XLA's path:\n{build_error()}", file=sys.stderr)
    return 1
  print(f"[expert_kernel] {library_path()}")
  return 0
