"""Parameter interpolation of Orbax checkpoints (report section 2.6): vertical agents trained by
RL from one SFT checkpoint stay approximately linearly mode-connected, so they are merged as
θ = Σ_k α_k θ_k instead of one joint RL run; task arithmetic θ_base + Σ_k λ_k (θ_k − θ_base) is the
same pytree arithmetic with the shared SFT start as the base.

  interpolate(["runs/browse/ppo", "runs/game/ppo"], [0.5, 0.5], "runs/merged")
  task_arithmetic("runs/main/sft", ["runs/browse/ppo", "runs/game/ppo"], [0.7, 0.7], "runs/ta")

Inputs, all of one kind:
  * an Orbax PyTree checkpoint directory, as `orbax.checkpoint.StandardCheckpointer` (or
    `train.checkpoint.save_tree`) writes it -> the output is such a directory;
  * a trainer checkpoint: a run dir (its latest step; a pipeline run dir `runs/x` means its newest
    stage, as for experiments/eval.py) or a step dir `<run>/checkpoints/<step>` holding the Composite
    items "state" and "meta" of `train.checkpoint.save` -> the output is a run dir (`config.json`,
    `checkpoints/<step>/`, `merge.json`) that `experiments/eval.py --run` and `--config.policy.init` read.

What each leaf becomes:
  * floating leaves: the weighted sum, accumulated in float32 (float64 for float64 leaves) and cast
    back to the leaf's dtype (bfloat16 parameters stay bfloat16);
  * integer / bool leaves (the step counter): taken from the first of `ckpt_dirs`, never averaged;
  * optimiser state (a subtree whose key ends in `_opt` or is `opt_state` / `optimizer`:
    the trainer's `policy_opt`, `critic_opt`), by `optimizer=`:
      "reset" (default): zeros, i.e. optax's fresh state for this project's clip + AdamW chain (count 0,
        moments 0). Section 2.6 merges parameters only and uses the merged model "without additional
        optimization"; Adam moments are running gradient statistics of each vertical's own objective,
        and their average is not the statistics of the merged point, so a run continuing from θ starts
        its optimiser afresh (as `--config.policy.init` already does with any checkpoint);
      "first": copied from the first checkpoint; "merge": treated like the parameters.
  The critic, when the checkpoint has one, is merged like the policy.

Memory: leaves are enumerated from Orbax's metadata (no array read) and read in groups of at most
`chunk_bytes` (a bigger leaf alone; `chunk_bytes=0`: strictly one leaf per read), one checkpoint at a
time, each group summed into its accumulator and freed before the next checkpoint's copy is read, so
the host holds the merged result (one model), about three groups and Orbax's 100 MB OCDBT read
cache, not N models; the result is written from those arrays without Orbax's default defensive copy
(`_tree_handler`). Groups instead of single leaves because Orbax parses the whole tree's metadata on
every restore call, which makes leaf-by-leaf reads quadratic in the number of leaves. With
`shardings` (a mesh), each leaf is read straight into its sharding and combined there.

Bad input fails before anything is written: `StructureMismatch` names the first differing leaf path
with both shapes and dtypes (and says when the difference is scanned vs unscanned layer layouts),
`ConfigMismatch` the first differing recorded model / tokenizer setting, `UnnormalisedWeights` α that
do not sum to 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from tars_jax.rollout.evaluation import resolve_run
from tars_jax.train import checkpoint
from tars_jax.train.state import checkpoint_location

SUM_TOL = 1e-6  # |Σα − 1| allowed without allow_unnormalised
OPTIMIZERS = ("reset", "first", "merge")
CONFIG_KEYS = ("model", "tokenizer")  # recorded settings that must agree (the rest, e.g. tasks, may differ)
_PYTREE_MARKER = "_METADATA"  # the tree-metadata file of an Orbax PyTree checkpoint directory


class MergeError(ValueError):
  """Checkpoints that cannot be merged, or bad merge arguments."""


class StructureMismatch(MergeError):
  """Two checkpoints differ in a leaf: `path` ('/'-joined keys), `shapes` and `dtypes` (first, other;
  None for a leaf the checkpoint lacks)."""

  def __init__(self, msg: str, path: str, shapes: tuple, dtypes: tuple):
    super().__init__(msg)
    self.path, self.shapes, self.dtypes = path, shapes, dtypes


class ConfigMismatch(MergeError):
  """Two trainer checkpoints record different model / tokenizer settings (`key`, `values`)."""

  def __init__(self, msg: str, key: str, values: tuple):
    super().__init__(msg)
    self.key, self.values = key, values


class DifferentStarts(MergeError):
  """Trainer checkpoints trained from different initial policies (`starts`: the two, as recorded)."""

  def __init__(self, msg: str, starts: tuple[str, str]):
    super().__init__(msg)
    self.starts = starts


class UnnormalisedWeights(MergeError):
  """Interpolation weights α whose sum is not 1 (pass allow_unnormalised=True to mean it)."""


@dataclasses.dataclass(frozen=True)
class Source:
  """One input checkpoint, resolved. kind: "tree" (a PyTree dir) or "trainer" (a run's step).
  tree_dir: the PyTree directory read (the step's "state" item for a trainer checkpoint)."""
  path: str
  kind: str
  tree_dir: str
  run_dir: str | None = None
  step: int | None = None


@dataclasses.dataclass(frozen=True)
class Leaf:
  """A checkpoint leaf from Orbax metadata: `path` (keys as strings), `shape`, `dtype` (numpy)."""
  path: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: Any

  @property
  def name(self) -> str:
    return "/".join(self.path)

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MergeResult:
  """What was written. out_dir: the checkpoint to hand on (the run dir for trainer inputs);
  checkpoint: the Orbax directory itself; counts of leaves merged / copied from the first
  checkpoint / reset to zero; nbytes: the merged tree's size."""
  out_dir: str
  kind: str
  checkpoint: str
  step: int | None
  merged: int
  copied: int
  reset: int
  nbytes: int


# ---------------------------------------------------------------------------------------------------
# Inputs: resolve paths, enumerate leaves, check they agree.


def resolve(path: str) -> Source:
  """The checkpoint a path names (see the module docstring for the accepted kinds).

  Raises: FileNotFoundError naming the path when it is neither kind, or the step does not exist.
  """
  path = os.path.abspath(path)
  if os.path.isfile(os.path.join(path, _PYTREE_MARKER)):
    return Source(path, "tree", path)
  run, step = checkpoint_location(path)
  if step is None and not os.path.isdir(os.path.join(run, "checkpoints")):
    try:  # a pipeline run dir -> its newest stage, as experiments/eval.py picks it
      run = os.path.abspath(resolve_run(run))
    except FileNotFoundError:
      raise FileNotFoundError(f"{path}: not an Orbax PyTree checkpoint (no {_PYTREE_MARKER}), nor a run dir "
                              f"with checkpoints/, nor a step dir <run>/checkpoints/<step>") from None
  if not os.path.isdir(os.path.join(run, "checkpoints")):
    raise FileNotFoundError(f"{path}: no checkpoints/ in run dir {run}")
  mngr = checkpoint.manager(run)
  try:
    steps = mngr.all_steps()
    step = mngr.latest_step() if step is None else step
  finally:
    mngr.close()
  if step is None or step not in steps:
    raise FileNotFoundError(f"{path}: no checkpoint {'' if step is None else step} in {run}/checkpoints "
                            f"(steps: {sorted(steps)})")
  return Source(path, "trainer", os.path.join(run, "checkpoints", str(step), "state"), run, step)


def _key(k) -> str:
  """One path entry as a string, whatever the container (dict key, sequence index, attribute)."""
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _keypath(path) -> tuple[str, ...]:
  return tuple(_key(k) for k in path)


def list_leaves(tree_dir: str) -> tuple[list[Leaf], Any]:
  """(leaves in Orbax's flattening order, treedef of the saved tree) from the checkpoint's metadata
  alone; no array is read. The treedef is of nested dicts / lists (how Orbax restores without a
  target) and keeps empty nodes (optax's EmptyState) as None."""
  md = ocp.PyTreeCheckpointer().metadata(tree_dir)
  md = getattr(md, "item_metadata", md)
  md = getattr(md, "tree", md)
  flat, treedef = jax.tree_util.tree_flatten_with_path(md)
  return [Leaf(_keypath(p), tuple(m.shape), np.dtype(m.dtype)) for p, m in flat], treedef


_INDEX = re.compile(r"^\d+$")


def _unindexed(path: tuple[str, ...]) -> tuple[str, ...]:
  return tuple(k for k in path if not _INDEX.match(k))


def _layout_hint(missing: Leaf, other: list[Leaf]) -> tuple[str, Leaf | None]:
  """(hint, counterpart) when `missing` is a per-layer leaf ('layers/0/…') whose stacked version
  ('layers/…', one more leading dim) is in `other`, or the reverse: scanned vs unscanned layers."""
  if _unindexed(missing.path) == missing.path:  # stacked here: look for a per-layer one there
    twin = next((o for o in other if _unindexed(o.path) == missing.path and o.path != missing.path), None)
  else:
    twin = next((o for o in other if o.path == _unindexed(missing.path)), None)
  if twin is None:
    return "", None
  return (" (scanned vs unscanned layer layouts: one checkpoint stacks the layers into one leaf with a "
          "leading layer dimension, the other has one leaf per layer; ModelConfig.scan_layers differs)"), twin


def check_structure(first: list[Leaf], other: list[Leaf], names: tuple[str, str]) -> None:
  """Raises StructureMismatch at the first leaf (in `first`'s order, then `other`'s extra leaves)
  whose path, shape or dtype differs; names label the two checkpoints in the message."""
  by_path = {leaf.path: leaf for leaf in other}
  a, b = names
  for leaf in first:
    o = by_path.get(leaf.path)
    if o is None:
      hint, twin = _layout_hint(leaf, other)
      shapes = (leaf.shape, twin.shape if twin else None)
      there = f"{twin.name!r} {twin.shape} {twin.dtype}" if twin else "absent"
      raise StructureMismatch(f"checkpoints differ at leaf {leaf.name!r}: {leaf.shape} {leaf.dtype} in {a}, "
                              f"{there} in {b}{hint}", leaf.name, shapes, (leaf.dtype, twin and twin.dtype))
    if o.shape != leaf.shape or o.dtype != leaf.dtype:
      raise StructureMismatch(f"checkpoints differ at leaf {leaf.name!r}: shape {leaf.shape} {leaf.dtype} in "
                              f"{a}, shape {o.shape} {o.dtype} in {b}", leaf.name, (leaf.shape, o.shape),
                              (leaf.dtype, o.dtype))
  have = {leaf.path for leaf in first}
  for o in other:
    if o.path not in have:
      hint, twin = _layout_hint(o, first)
      raise StructureMismatch(f"checkpoints differ at leaf {o.name!r}: absent in {a}, {o.shape} {o.dtype} in "
                              f"{b}{hint}", o.name, (twin.shape if twin else None, o.shape),
                              (twin and twin.dtype, o.dtype))


def run_config(src: Source) -> dict | None:
  """The run's config.json (a trainer checkpoint), or None where none is recorded."""
  if src.run_dir is None or not os.path.isfile(os.path.join(src.run_dir, "config.json")):
    return None
  with open(os.path.join(src.run_dir, "config.json")) as f:
    return json.load(f)


def _first_difference(a, b, prefix: str) -> tuple[str, Any, Any] | None:
  if isinstance(a, dict) and isinstance(b, dict):
    for k in list(a) + [k for k in b if k not in a]:
      d = _first_difference(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{prefix}.{k}")
      if d:
        return d
    return None
  return None if a == b else (prefix, a, b)


def check_configs(configs: Sequence[dict | None], names: Sequence[str]) -> None:
  """Raises ConfigMismatch naming the first `CONFIG_KEYS` setting (e.g. `model.scan_layers`) that a
  recorded config does not share with the first recorded one. Configs not recorded are skipped."""
  recorded = [(c, n) for c, n in zip(configs, names) if c is not None]
  if len(recorded) < 2:
    return
  (ref, ref_name), rest = recorded[0], recorded[1:]
  for cfg, name in rest:
    for key in CONFIG_KEYS:
      d = _first_difference(ref.get(key, "<absent>"), cfg.get(key, "<absent>"), key)
      if d:
        raise ConfigMismatch(f"checkpoints of different configs: {d[0]} = {d[1]!r} in {ref_name}, {d[2]!r} in "
                             f"{name}", d[0], (d[1], d[2]))


def start_of(cfg: dict) -> str:
  """The policy a run's training started from, as its config.json records it: `policy.init` (a run or
  checkpoint path; absolute where it exists here), or "fresh init (seed S)" where it is empty."""
  init = (cfg.get("policy") or {}).get("init") or ""
  if not init:
    return f"fresh init (seed {cfg.get('seed')})"
  return os.path.realpath(init) if os.path.exists(init) else init


def check_starts(configs: Sequence[dict | None], names: Sequence[str], allow: bool = False) -> None:
  """Raises DifferentStarts naming two checkpoints and their starts when the recorded configs do not
  share one initial policy (`start_of`), unless `allow`: parameter interpolation of report section 2.6
  averages verticals fine-tuned from one SFT checkpoint; from different starts their parameters need not
  lie in one basin. Configs not recorded are skipped."""
  recorded = [(start_of(c), n) for c, n in zip(configs, names) if c is not None]
  for start, name in recorded[1:]:
    if start != recorded[0][0] and not allow:
      raise DifferentStarts(f"checkpoints from different starts: {recorded[0][1]} started from "
                            f"{recorded[0][0]}, {name} from {start}; merge verticals of one SFT checkpoint, or "
                            f"pass allow_different_starts=True (--allow_different_starts) to mean it",
                            (recorded[0][0], start))


def check_weights(weights: Sequence[float], n: int, what: str, normalised: bool) -> list[float]:
  """Floats, one per checkpoint, finite; with `normalised`, summing to 1 within SUM_TOL.
  Raises: MergeError (count, non-finite); UnnormalisedWeights (the sum)."""
  w = [float(x) for x in weights]
  if len(w) != n or n == 0:
    raise MergeError(f"{len(w)} {what} for {n} checkpoints: give one per checkpoint (at least one)")
  if not all(math.isfinite(x) for x in w):
    raise MergeError(f"{what} must be finite, got {w}")
  if normalised and abs(sum(w) - 1.0) > SUM_TOL:
    raise UnnormalisedWeights(f"{what} {w} sum to {sum(w):.9g}, not 1 (tolerance {SUM_TOL}); pass "
                              f"allow_unnormalised=True (--allow_unnormalised) to scale the parameters")
  return w


# ---------------------------------------------------------------------------------------------------
# Reading and combining, a group of leaves at a time.


def is_optimizer(path: tuple[str, ...]) -> bool:
  """Whether a leaf lies in an optimiser-state subtree (`policy_opt`, `critic_opt`, `opt_state`, ...)."""
  return any(k.endswith("_opt") or k in ("opt", "opt_state", "optimizer") for k in path)


def is_float(dtype) -> bool:
  return bool(jnp.issubdtype(dtype, jnp.floating))


def _accum_dtype(dtype):
  return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def groups(indices: Sequence[int], leaves_: Sequence[Leaf], chunk_bytes: int) -> list[list[int]]:
  """Consecutive runs of `indices` whose leaves total at most `chunk_bytes` (a bigger leaf alone)."""
  out, cur, size = [], [], 0
  for i in indices:
    n = leaves_[i].nbytes
    if cur and size + n > chunk_bytes:
      out.append(cur)
      cur, size = [], 0
    cur.append(i)
    size += n
  return out + ([cur] if cur else [])


def _shardings_by_path(shardings, leaves_: Sequence[Leaf]) -> list | None:
  """One Sharding (or None) per leaf from `shardings`: None, one Sharding for all, or a pytree matched
  to the checkpoint's leaves by key path (e.g. `sharding.logical_to_sharding(abstract_state, mesh)`:
  nnx.State and optax states flatten to the same keys as Orbax's metadata)."""
  if shardings is None:
    return None
  if isinstance(shardings, jax.sharding.Sharding):
    return [shardings] * len(leaves_)
  flat = jax.tree_util.tree_flatten_with_path(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
  table = {_keypath(p): s for p, s in flat}
  missing = [leaf.name for leaf in leaves_ if leaf.path not in table]
  if missing:
    raise MergeError(f"shardings has no entry for {len(missing)} checkpoint leaves, e.g. {missing[0]!r}")
  return [table[leaf.path] for leaf in leaves_]


def read(tree_dir: str, treedef, leaves_: Sequence[Leaf], idx: Sequence[int], shardings=None) -> dict:
  """{i: array} for the leaves `idx` of one checkpoint (one Orbax restore; the others are skipped as
  placeholders): numpy on the host, or jax.Arrays in `shardings[i]`."""
  want = set(idx)

  def arg(i, leaf):
    if i not in want:
      return ocp.PLACEHOLDER
    if shardings is None:
      return ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=shardings[i], global_shape=leaf.shape,
                                dtype=leaf.dtype)

  item = treedef.unflatten([jax.ShapeDtypeStruct(l.shape, l.dtype) if i in want else ocp.PLACEHOLDER
                            for i, l in enumerate(leaves_)])
  args = treedef.unflatten([arg(i, l) for i, l in enumerate(leaves_)])
  out = ocp.PyTreeCheckpointer().restore(tree_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args))
  flat = jax.tree_util.tree_leaves(out, is_leaf=lambda x: x is ocp.PLACEHOLDER)
  return {i: flat[i] for i in idx}


def _as(x, dtype):
  return x if x.dtype == dtype else x.astype(dtype)  # no copy of a leaf already in the right dtype


def combine_group(read_fn: Callable[[int, list[int]], dict], idx: list[int], leaves_: Sequence[Leaf],
                  weights: Sequence[float], with_base: bool) -> dict:
  """{i: merged leaf} for the group `idx`. read_fn(k, idx) -> {i: array} reads the group from input
  k, where input 0 is the base when `with_base` and the next inputs carry `weights`. Computes
  Σ w_k x_k, or base + Σ w_k (x_k − base) (the task vector first: nearby parameters subtract without
  rounding), in the accumulation dtype, cast back to each leaf's dtype. At most the accumulator, the
  base and one input's copy of the group are alive at once."""
  def load(k):
    return {i: _as(x, _accum_dtype(leaves_[i].dtype)) for i, x in read_fn(k, idx).items()}

  base = load(0) if with_base else None
  acc = dict(base) if with_base else {}
  for k, w in enumerate(weights):
    xs = load(k + int(with_base))
    for i in idx:
      x = xs.pop(i)
      term = w * (x - base[i]) if with_base else w * x
      acc[i] = acc[i] + term if i in acc else term
    del xs
  return {i: _as(acc.pop(i), leaves_[i].dtype) for i in idx}


def _zeros(leaf: Leaf, sharding):
  if sharding is None:
    return np.zeros(leaf.shape, leaf.dtype)
  # shard by shard: neither a host copy of the whole leaf nor a compilation per shape
  def shard(idx):  # idx: one slice per dimension
    return np.zeros([len(range(*sl.indices(n))) for sl, n in zip(idx, leaf.shape)], leaf.dtype)
  return jax.make_array_from_callback(leaf.shape, sharding, shard)


# ---------------------------------------------------------------------------------------------------
# Writing.


def _check_out_dir(out_dir: str, sources: Sequence[Source], overwrite: bool) -> str:
  out = os.path.abspath(out_dir)
  for s in sources:
    for d in filter(None, (s.run_dir, s.tree_dir)):  # the checkpoint's own dirs (a pipeline dir may hold out)
      if out == d or d.startswith(out + os.sep) or out.startswith(d + os.sep):
        raise MergeError(f"out_dir {out} overlaps the input {d}: write the merged checkpoint elsewhere")
  if os.path.exists(out) and not os.path.isdir(out):
    raise FileExistsError(f"out_dir {out} is a file")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise FileExistsError(f"out_dir {out} exists and is not empty (overwrite=True / --overwrite replaces it)")
  return out


def _read_meta(src: Source) -> dict:
  """The JSON `meta` item saved beside the trainer state (iteration, data iterator state...)."""
  if not os.path.isdir(os.path.join(src.run_dir, "checkpoints", str(src.step), "meta")):
    return {}
  mngr = checkpoint.manager(src.run_dir)
  try:
    out = mngr.restore(src.step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  finally:
    mngr.close()
  return dict(out["meta"] or {})


def _tree_handler() -> ocp.PyTreeCheckpointHandler:
  """The PyTree handler `StandardCheckpointer` wraps (same files), except that numpy leaves are written
  from the arrays themselves: Orbax's default deep-copies every host array before writing, which
  would hold a second copy of the merged model at the peak."""
  kept = (int, float, bytes, np.number, jax.Array, str, type(ocp.PLACEHOLDER))
  registry = ocp.type_handlers.create_type_handler_registry(
      (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
      *[(t, ocp.type_handlers.get_type_handler(t)) for t in kept])
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _write(out: str, first: Source, tree, provenance: dict, overwrite: bool) -> tuple[str, int | None]:
  """Writes the merged tree in the kind of the inputs, with `first`'s meta and config.json (trainer
  kind); returns (Orbax directory, step). The layouts are those of `train.checkpoint.save_tree` and
  `train.checkpoint.save` (read back by their restore functions), written through `_tree_handler`."""
  if overwrite and os.path.isdir(out):
    shutil.rmtree(out)
  if first.kind == "tree":
    ocp.Checkpointer(_tree_handler()).save(out, args=ocp.args.PyTreeSave(tree))
    return out, None
  meta = dict(_read_meta(first), merge=provenance)
  opts = ocp.CheckpointManagerOptions(create=True)
  mngr = ocp.CheckpointManager(os.path.join(out, "checkpoints"), options=opts,
                               item_handlers={"state": _tree_handler(), "meta": ocp.JsonCheckpointHandler()})
  try:
    mngr.save(first.step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree), meta=ocp.args.JsonSave(meta)))
    mngr.wait_until_finished()
  finally:
    mngr.close()
  if os.path.isfile(os.path.join(first.run_dir, "config.json")):  # eval.py builds the model from it
    shutil.copyfile(os.path.join(first.run_dir, "config.json"), os.path.join(out, "config.json"))
  with open(os.path.join(out, "merge.json"), "w") as f:
    json.dump(provenance, f, indent=2)
  return os.path.join(out, "checkpoints", str(first.step)), first.step


# ---------------------------------------------------------------------------------------------------
# The merge.


def _check_inputs(inputs: Sequence[str], allow_different_starts: bool, with_base: bool
                  ) -> tuple[list[Source], list[Leaf], Any]:
  """Resolves the inputs and checks they can be merged: one kind, the same recorded model config,
  one start (of the checkpoints, not the base; unless allowed), the same leaves. Returns (sources,
  leaves, treedef of the first). Reads metadata only."""
  sources = [resolve(p) for p in inputs]
  if len({s.kind for s in sources}) > 1:
    raise MergeError("inputs mix Orbax PyTree dirs and trainer checkpoints: "
                     + ", ".join(f"{s.path} ({s.kind})" for s in sources))
  names = [s.path for s in sources]
  configs = [run_config(s) for s in sources]
  check_configs(configs, names)
  check_starts(configs[int(with_base):], names[int(with_base):], allow_different_starts)
  metas = [list_leaves(s.tree_dir) for s in sources]
  for (lv, _), name in zip(metas[1:], names[1:]):
    check_structure(metas[0][0], lv, (names[0], name))
  return sources, *metas[0]


def classify(leaves_: Sequence[Leaf], optimizer: str) -> list[str]:
  """Per leaf: "merge" (floating parameters), "copy" (integers and bools; optimiser state with
  optimizer="first") or "reset" (optimiser state with optimizer="reset")."""
  if optimizer not in OPTIMIZERS:
    raise MergeError(f"optimizer={optimizer!r}: one of {OPTIMIZERS}")

  def one(leaf):
    opt = is_optimizer(leaf.path)
    if opt and optimizer == "reset":
      return "reset"
    return "copy" if not is_float(leaf.dtype) or (opt and optimizer == "first") else "merge"
  return [one(leaf) for leaf in leaves_]


def _merge(inputs: Sequence[str], weights: Sequence[float], out_dir: str, *, with_base: bool,
           provenance: dict, optimizer: str, shardings, chunk_bytes: int, overwrite: bool,
           allow_different_starts: bool) -> MergeResult:
  """inputs: [base] + checkpoints when `with_base`; weights: one per checkpoint (not the base)."""
  sources, lv, treedef = _check_inputs(inputs, allow_different_starts, with_base)
  kind = classify(lv, optimizer)
  shard = _shardings_by_path(shardings, lv)
  out = _check_out_dir(out_dir, sources, overwrite)
  # Nothing is written above this line.

  first = int(with_base)  # the first checkpoint, not the base, gives copied leaves, meta and config
  read_fn = lambda k, idx: read(sources[k].tree_dir, treedef, lv, idx, shard)  # noqa: E731
  merged: list = [None] * len(lv)
  for g in groups([i for i, k in enumerate(kind) if k == "merge"], lv, chunk_bytes):
    for i, x in combine_group(read_fn, g, lv, weights, with_base).items():
      merged[i] = x
  for g in groups([i for i, k in enumerate(kind) if k == "copy"], lv, chunk_bytes):
    for i, x in read_fn(first, g).items():
      merged[i] = x
  for i, k in enumerate(kind):
    if k == "reset":
      merged[i] = _zeros(lv[i], shard[i] if shard else None)
  provenance = dict(provenance, inputs=[dataclasses.asdict(s) for s in sources], optimizer=optimizer)
  path, step = _write(out, sources[first], treedef.unflatten(merged), provenance, overwrite)
  return MergeResult(out_dir=out, kind=sources[0].kind, checkpoint=path, step=step,
                     merged=kind.count("merge"), copied=kind.count("copy"), reset=kind.count("reset"),
                     nbytes=sum(leaf.nbytes for leaf in lv))


def interpolate(ckpt_dirs: Sequence[str], alphas: Sequence[float], out_dir: str, *,
                allow_unnormalised: bool = False, optimizer: str = "reset", shardings=None,
                chunk_bytes: int = 128 << 20, overwrite: bool = False,
                allow_different_starts: bool = False) -> MergeResult:
  """θ = Σ_k α_k θ_k over N checkpoints of one model (report section 2.6, eq. 5), written to `out_dir`.

  Args:
    ckpt_dirs: N >= 1 checkpoints, all Orbax PyTree dirs or all trainer checkpoints (run or step dirs).
      Every leaf must have the same path, shape [...] and dtype in all of them.
    alphas: N floats summing to 1 (within SUM_TOL = 1e-6).
    out_dir: a new (or empty) directory; the merged checkpoint is of the inputs' kind.
    allow_unnormalised: accept α whose sum is not 1 (the result is then a scaled model).
    optimizer: optimiser-state leaves: "reset" (zeros = a fresh optax state), "first", "merge"
      (see the module docstring for why "reset").
    shardings: None (host numpy), a `jax.sharding.Sharding` for every leaf, or a pytree of them
      matched by key path (e.g. of the train state); each leaf is read into its sharding.
    chunk_bytes: most bytes read per Orbax restore call; peak host memory ~ the merged model + about
      3 x this + Orbax's read cache (100 MB).
    overwrite: replace a non-empty `out_dir`.
    allow_different_starts: merge trainer checkpoints whose runs started from different policies.
  Returns: MergeResult (where it was written, counts of merged / copied / reset leaves).
  Raises (all before anything is written): FileNotFoundError (no such checkpoint); MergeError (mixed
    kinds, weight count, non-finite weights, out_dir overlapping an input, bad `optimizer`);
    UnnormalisedWeights; StructureMismatch (first differing leaf path, both shapes / dtypes, scanned vs
    unscanned layers); ConfigMismatch (recorded model / tokenizer settings differ); DifferentStarts
    (recorded `policy.init` differs, see `check_starts`); FileExistsError
    (`out_dir` not empty).
  """
  w = check_weights(alphas, len(ckpt_dirs), "alphas", normalised=not allow_unnormalised)
  prov = {"op": "interpolate", "alphas": w}
  return _merge(list(ckpt_dirs), w, out_dir, with_base=False, provenance=prov, optimizer=optimizer,
                shardings=shardings, chunk_bytes=chunk_bytes, overwrite=overwrite,
                allow_different_starts=allow_different_starts)


def task_arithmetic(base_dir: str, ckpt_dirs: Sequence[str], lambdas: Sequence[float], out_dir: str, *,
                    optimizer: str = "reset", shardings=None, chunk_bytes: int = 128 << 20,
                    overwrite: bool = False, allow_different_starts: bool = False) -> MergeResult:
  """θ = θ_base + Σ_k λ_k (θ_k − θ_base): task vectors of verticals trained from one start `base_dir`
  (the shared SFT checkpoint of report section 2.6) added back to it. λ need not sum to 1
  (λ_k = 1/N is `interpolate` with uniform α). Integer leaves, the recorded meta and config.json
  come from ckpt_dirs[0], not from the base. Other arguments, return and errors as `interpolate`
  (the base must match the checkpoints' structure and config too).
  """
  w = check_weights(lambdas, len(ckpt_dirs), "lambdas", normalised=False)
  prov = {"op": "task_arithmetic", "lambdas": w, "base": os.path.abspath(base_dir)}
  return _merge([base_dir, *ckpt_dirs], w, out_dir, with_base=True, provenance=prov, optimizer=optimizer,
                shardings=shardings, chunk_bytes=chunk_bytes, overwrite=overwrite,
                allow_different_starts=allow_different_starts)
