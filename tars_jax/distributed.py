"""Multi-process runs through JAX's own runtime (`jax.distributed`): one trainer process per host (or
per device group), the mesh spanning all of them, each process driving its share of the sandbox fleet.

Everything here is a no-op with one process (`distributed.num_processes = 1`, the default), so a
single-process run is unchanged. The pieces, in the order a trainer uses them:

  initialize(config.distributed)      # before any JAX computation; CPU runs get gloo collectives
  default_mesh(config)                # >1 process and no config.mesh.shape: data parallel, all devices
  jobs = share(all_jobs)              # this process's contiguous block of the rollout jobs
  urls = server_share(config.env.servers)   # and of the sandbox servers
  episodes = allgather_list(episodes) # every process gets every episode, in job order
  params = local_replica(state["policy"])  # a full copy on this process's device, for its rollouts
  if is_main(): write metrics ...     # Orbax saves/restores run on every process (Orbax's rule)

Why every episode goes to every process: the update then sees the same batch, in the same row order,
as one process would (group baselines, `n_real`, minibatch shuffles), so a run gives the same update
whatever its process count; the batch is small next to the model (tokens + screenshots of one
iteration). `global_batch_from_local` is the other way in, for callers whose processes each hold only
their own rows (`jax.make_array_from_process_local_data`).

Failure (issue #27, "a worker process that dies"): JAX's coordination service declares a process
dead when its heartbeats stop for `heartbeat_timeout_s` and then terminates every other process,
naming the task ("Task 1 heartbeat timeout"); a collective with a dead peer fails at once on CPU (gloo:
"Connection closed by peer"). `fail_fast` turns such a failure into an exit that names the dead
process(es) (`PeerFailure` message, exit status `EXIT_PEER_FAILED`), and makes a process that fails
on its own exit at once instead of waiting at JAX's shutdown barrier. Re-running the launch command
resumes from the last complete Orbax checkpoint.

Sources: JAX multi-process guide (docs/multi_process.md, `jax.distributed.initialize`, cluster
auto-detection for SLURM / Open MPI), `jax.experimental.multihost_utils` (`process_allgather`),
`jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

EXIT_PEER_FAILED = 75  # exit status of a process that stops because a peer died (EX_TEMPFAIL: re-run resumes)
_HEARTBEAT_S = [100.0]  # heartbeat timeout of the running job (set by `initialize`), for `fail_fast`
# What `fail_fast` asks when a collective lost a peer: the shared services that may have failed it
_PROBES: list[Callable[[], BaseException | None]] = []


class PeerFailure(RuntimeError):
  """A peer process of a multi-process run died; `.dead` lists the process ids (ranks) found dead."""

  def __init__(self, dead: Sequence[int], me: int, total: int, cause: str):
    self.dead = tuple(dead)
    names = ", ".join(str(d) for d in self.dead) or "unknown"
    super().__init__(f"process {me} of {total}: peer process(es) [{names}] died ({cause}); "
                     "re-run the launch command on every host to resume from the last checkpoint")


# --- start-up ----------------------------------------------------------------------------------------

def initialize(dcfg) -> tuple[int, int]:
  """Starts `jax.distributed` as `config.distributed` says; returns (process_id, num_processes).

  dcfg fields: num_processes (1 = one process, nothing is started; 0 = all four of coordinator,
  count, id and local devices auto-detected by JAX from the cluster environment: SLURM, Open MPI,
  ...; N > 1 = explicit), process_id (-1 = auto-detected), coordinator_address ("" = the
  JAX_COORDINATOR_ADDRESS env var or auto-detected; "host:port" of process 0), heartbeat_timeout_s
  (seconds without heartbeats after which JAX declares a process dead), initialization_timeout_s
  (seconds to wait for every process to connect), cpu_collectives ("gloo" or "mpi": the
  cross-process collectives of the CPU backend, `jax_cpu_collectives_implementation`).
  Must run before the first JAX computation (the backends read the distributed client when made).
  Raises: ValueError for num_processes < 0 or a process_id out of range; RuntimeError / TimeoutError
    from JAX when the coordinator cannot be reached within initialization_timeout_s.
  """
  n = int(dcfg.num_processes)
  if n < 0:
    raise ValueError(f"distributed.num_processes must be >= 0 (0 = auto-detect), got {n}")
  if n == 1:
    return 0, 1
  pid = int(dcfg.process_id)
  if n > 1 and not -1 <= pid < n:
    raise ValueError(f"distributed.process_id must be in [0, {n}) (or -1 = auto-detect), got {pid}")
  jax.config.update("jax_cpu_collectives_implementation", dcfg.cpu_collectives)
  _HEARTBEAT_S[0] = float(dcfg.heartbeat_timeout_s)
  jax.distributed.initialize(coordinator_address=dcfg.coordinator_address or None,
                             num_processes=n or None, process_id=None if pid < 0 else pid,
                             initialization_timeout=int(dcfg.initialization_timeout_s),
                             heartbeat_timeout_seconds=int(dcfg.heartbeat_timeout_s))
  print(f"[distributed] process {jax.process_index()} of {jax.process_count()}: "
        f"{len(jax.local_devices())} local / {jax.device_count()} global devices", flush=True)
  return jax.process_index(), jax.process_count()


def is_multi() -> bool:
  """True in a run of more than one process."""
  return jax.process_count() > 1


def is_main() -> bool:
  """True on process 0: the one that writes metrics, TensorBoard, config.json and trajectories."""
  return jax.process_index() == 0


def default_mesh(config) -> None:
  """With more than one process and no `config.mesh.shape`, sets it to (all devices, 1, 1, 1): data
  parallel over every process (a per-process state would not be one model). Mutates `config` (the
  resolved shape is what config.json records)."""
  if is_multi() and not config.mesh.get("shape"):
    with config.unlocked():
      config.mesh.shape = (jax.device_count(), 1, 1, 1)
    print(f"[distributed] mesh.shape unset: data parallel over {jax.device_count()} devices", flush=True)


def process_seed(seed: int) -> int:
  """Sampling seed of this process: `seed` on process 0 (a one-process run is unchanged), a distinct
  stream on the others (else every process would draw the same random numbers for its episodes)."""
  return seed + 1_000_003 * jax.process_index()


# --- sharing the work --------------------------------------------------------------------------------

def _block(n: int, p: int, k: int) -> tuple[int, int]:
  """[start, end) of block p of n items over k processes (`np.array_split` sizes: the first n % k
  blocks have one more)."""
  q, r = divmod(n, k)
  start = p * q + min(p, r)
  return start, start + q + (p < r)


def share(items: Sequence) -> list:
  """This process's contiguous block of `items` (rollout or evaluation jobs), `np.array_split`
  sizes; concatenating the blocks in process order gives `items` back (so `allgather_list` of
  per-job results is in job order). One process: all of them."""
  s, e = _block(len(items), jax.process_index(), jax.process_count())
  return list(items[s:e])


def share_size(n: int) -> int:
  """The largest block `share` makes of n items: the batch size of a process's policy."""
  return -(-n // jax.process_count())


def server_share(servers: Sequence[str]) -> tuple[str, ...]:
  """Sandbox server URLs this process drives: every k-th (k processes) when there are at least as
  many servers as processes; all of them when fewer (they are shared); () stays () (each process
  launches its own local servers)."""
  k, p = jax.process_count(), jax.process_index()
  servers = tuple(servers)
  return servers[p::k] if len(servers) >= k else servers


# --- moving data between processes ------------------------------------------------------------------

def allgather_list(items: list) -> list:
  """Concatenation, in process order, of every process's `items` (any picklable objects, e.g.
  Episodes with their screenshots); every process must call it. One process: `items` itself.

  Objects travel pickled as uint8 arrays through `multihost_utils.process_allgather` (JAX's own
  collectives: gloo on CPU), padded to the longest."""
  if not is_multi():
    return items
  blob = np.frombuffer(pickle.dumps(list(items), protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([blob.size], np.int64))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:blob.size] = blob
  every = np.asarray(multihost_utils.process_allgather(padded))  # [processes, max size]
  return [x for row, size in zip(every, sizes) for x in pickle.loads(row[:int(size)].tobytes())]


def any_process(flag: bool) -> bool:
  """Whether `flag` is true on any process; every process must call it. One process: `flag`. A loop
  that stops on a per-process condition (a wall-clock guard, a SIGTERM to one process) stops at the
  same step everywhere, so no process enters the checkpoint's collectives while another trains on."""
  if not is_multi():
    return bool(flag)
  return bool(np.asarray(multihost_utils.process_allgather(np.array([bool(flag)]))).any())


def barrier(name: str) -> None:
  """Every process waits here until all have arrived (`multihost_utils.sync_global_devices`); `name`
  must be the same on every process. One process: returns at once."""
  if is_multi():
    multihost_utils.sync_global_devices(name)


def merge_counters(objs: Sequence[Any]) -> Any:
  """One dataclass of counters from one per process (e.g. `RolloutStats`): numeric fields summed,
  dict fields summed per key (so times are process-seconds). One object: itself."""
  if len(objs) == 1:
    return objs[0]
  out = {}
  for f in dataclasses.fields(objs[0]):
    vals = [getattr(o, f.name) for o in objs]
    if isinstance(vals[0], dict):
      merged: dict = {}
      for v in vals:
        for k, x in v.items():
          merged[k] = merged.get(k, 0) + x
      out[f.name] = merged
    else:
      out[f.name] = sum(vals)
  return dataclasses.replace(objs[0], **out)


def to_host(x) -> np.ndarray:
  """numpy value of `x`: `np.asarray` for numpy and fully addressable arrays; for an array spread
  over several processes, its global value gathered to every process (a collective: every process
  must call it, in the same order)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def local_replica(tree: Any) -> Any:
  """`tree` (e.g. policy parameters sharded over a multi-process mesh) as a full copy on this
  process's first local device, for computations each process runs alone (its rollouts). One
  process: `tree` itself (same object). A collective with more than one process."""
  if not is_multi():
    return tree
  return jax.device_put(multihost_utils.process_allgather(tree, tiled=True), jax.local_devices()[0])


def global_batch_from_local(local: dict[str, np.ndarray], mesh, rules=None) -> dict[str, jax.Array]:
  """Global arrays of a batch whose rows are split over the processes: process p holds rows
  [p * n, (p + 1) * n) (`local`: name -> [n, ...] array, same n on every process); the result has
  [n * processes, ...] rows laid out by the `act_batch` rule (`sharding.activation_spec`) over
  `mesh` (`jax.make_array_from_process_local_data`).

  Raises: ValueError when the batch axis is not split over the processes in process order (then
  each process would have to hold rows it does not have; gather with `allgather_list` instead).
  """
  from tars_jax import sharding  # local: sharding imports nothing from here, keep it that way
  from jax.sharding import NamedSharding
  rules = sharding.make_rules() if rules is None else rules
  k, p = jax.process_count(), jax.process_index()
  out = {}
  for name, v in local.items():
    v = np.asarray(v)
    shape = (v.shape[0] * k,) + v.shape[1:]
    spec = sharding.activation_spec(("act_batch",) + (None,) * (v.ndim - 1), shape, mesh, rules)
    target = NamedSharding(mesh, spec)
    rows = sorted({idx[0].indices(shape[0])[:2] for idx in target.addressable_devices_indices_map(shape).values()})
    lo, hi = rows[0][0], rows[-1][1]
    if (lo, hi) != (p * v.shape[0], (p + 1) * v.shape[0]):
      raise ValueError(f"{name}: process {p} holds rows [{p * v.shape[0]}, {(p + 1) * v.shape[0]}) but its "
                       f"devices hold rows [{lo}, {hi}) of spec {spec} on mesh {dict(mesh.shape)}")
    out[name] = jax.make_array_from_process_local_data(target, v, shape)
  return out


# --- failure -----------------------------------------------------------------------------------------

def _client():
  from jax._src import distributed as _d  # the one handle on the coordination service JAX exposes
  return _d.global_state.client


def dead_processes(timeout_s: float) -> list[int] | None:
  """Process ids the coordination service no longer counts as live, or None if it could not tell
  within `timeout_s` seconds (the call waits for every live process, like a barrier, so it returns
  once the service has declared the dead ones dead: about `heartbeat_timeout_s`)."""
  result: list = []

  def ask():
    try:
      live = _client().get_live_nodes(list(range(jax.process_count())))
      result.append(sorted(set(range(jax.process_count())) - set(live)))
    except Exception as e:  # noqa: BLE001 -- the coordinator itself may be the dead one
      result.append(e)

  t = threading.Thread(target=ask, daemon=True)
  t.start()
  t.join(timeout_s)
  if not result:
    return None
  if isinstance(result[0], Exception):
    return [0] if "coordination service" in str(result[0]) else None  # process 0 hosts the service
  return result[0]


def _looks_like_peer_failure(exc: BaseException) -> bool:
  text = f"{type(exc).__name__}: {exc}"
  return isinstance(exc, jax.errors.JaxRuntimeError) or any(
      s in text for s in ("Gloo", "gloo", "Connection closed", "coordination service", "heartbeat"))


def on_peer_failure(probe: Callable[[], BaseException | None]) -> None:
  """Registers `probe` (returns the error of a shared service this process uses, e.g.
  `RemoteInference.probe`, or None when it answers; must return within seconds) for `fail_fast`: a
  peer that stopped because that service failed is then reported by the service's error, on every
  process, not as an anonymous dead peer."""
  _PROBES.append(probe)


def fail_fast(fn: Callable) -> Callable:
  """`fn` wrapped for multi-process runs: an exception in a run of more than one process ends this
  process at once (`os._exit`: JAX's shutdown barrier would hold it while its peers wait in a
  collective). If the exception looks like a collective that lost a peer, the probes registered with
  `on_peer_failure` run first: the first error one returns is printed as the cause (exit status 1, as
  on the peer that met it); if none does, the dead process ids are asked of the coordination service
  (waiting up to `distributed.heartbeat_timeout_s` + 30 s) and printed as a `PeerFailure`, exit status
  `EXIT_PEER_FAILED`. Any other exception: the traceback is printed, exit status 1.
  One process: `fn` unchanged in behaviour (exceptions propagate)."""

  @functools.wraps(fn)
  def run(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 -- re-raised below unless several processes run
      if not (jax.distributed.is_initialized() and is_multi()) or isinstance(e, SystemExit) and not e.code:
        raise
      me, total = jax.process_index(), jax.process_count()
      if _looks_like_peer_failure(e):
        print(f"[distributed] process {me} of {total}: a collective failed ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:300]}); asking the coordination service which process died",
              file=sys.stderr, flush=True)
        cause = next((c for c in (probe() for probe in _PROBES) if c is not None), None)
        if cause is not None:
          print(f"[distributed] process {me} of {total}: the shared service failed: {type(cause).__name__}: "
                f"{cause}", file=sys.stderr, flush=True)
          os._exit(1)
        dead = dead_processes(_HEARTBEAT_S[0] + 30)
        print(f"[distributed] {PeerFailure(dead or [], me, total, 'collective failed')}", file=sys.stderr,
              flush=True)
        os._exit(EXIT_PEER_FAILED)
      traceback.print_exc()
      print(f"[distributed] process {me} of {total} failed; exiting so that its peers stop",
            file=sys.stderr, flush=True)
      os._exit(1)

  return run


class NullWriter:
  """Stand-in for `MetricsWriter` on processes other than 0: same attributes, writes nothing."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tb_dir = os.path.join(workdir, "tensorboard")

  def write(self, step: int, scalars: dict) -> None:
    del step, scalars

  def close(self) -> None:
    pass


__all__ = ["EXIT_PEER_FAILED", "PeerFailure", "initialize", "on_peer_failure", "is_multi", "is_main", "default_mesh",
           "process_seed", "share", "share_size", "server_share", "allgather_list", "barrier", "merge_counters",
           "to_host", "local_replica", "global_batch_from_local", "dead_processes", "fail_fast",
           "NullWriter"]
