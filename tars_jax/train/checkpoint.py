"""Orbax checkpoints of the train state under `<workdir>/checkpoints/<step>/`.

A run resumes from the last *complete* checkpoint: Orbax writes each step to a temporary directory
and renames it when finished, so a run killed mid-save leaves the previous step as the latest.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def manager(workdir: str, max_to_keep: int = 3, cleanup_tmp: bool = False) -> ocp.CheckpointManager:
  """CheckpointManager over `<workdir>/checkpoints` keeping the last `max_to_keep` steps.

  cleanup_tmp: delete the temporary directories of saves that never finished (a writer killed
    mid-save), in a background thread that the manager's first save waits for. Only for the
    process that writes the run: in a reader (eval of a run still training)
    it would delete the writer's save in progress.
  """
  path = os.path.abspath(os.path.join(workdir, "checkpoints"))
  opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=cleanup_tmp)
  return ocp.CheckpointManager(path, options=opts)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict | None = None) -> None:
  """Saves `state` (any pytree of arrays) and JSON `meta` at `step`; blocks until written."""
  args = {"state": ocp.args.StandardSave(state)}
  if meta is not None:
    args["meta"] = ocp.args.JsonSave(meta)
  mngr.save(step, args=ocp.args.Composite(**args))
  mngr.wait_until_finished()


def save_at_stop(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
  """The checkpoint a run that made steps writes when its loop stops at `step` (its count budget, or
  its wall-clock guard: tars_jax/train/guard.py): a new one unless the latest is already `step`."""
  if mngr.latest_step() != step:
    save(mngr, step, state, meta)


def restore(mngr: ocp.CheckpointManager, target: Any, step: int | None = None) -> tuple[int, Any, dict]:
  """Restores (step, state, meta) into the structure/shardings of `target`.

  Args:
    step: which step; None = latest complete one.
  Raises:
    FileNotFoundError: there is no checkpoint (or not that step).
  """
  step = mngr.latest_step() if step is None else step
  if step is None or step not in mngr.all_steps():
    raise FileNotFoundError(f"no checkpoint {'' if step is None else step} in {mngr.directory}")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                   meta=ocp.args.JsonRestore()))
  return step, out["state"], dict(out["meta"] or {})


def save_tree(path: str, tree: Any) -> str:
  """Saves one pytree of arrays (e.g. critic parameters) at `path` (a new directory); returns the
  absolute path. Overwrites an existing checkpoint there."""
  path = os.path.abspath(path)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, tree, force=True)
  ckptr.wait_until_finished()
  return path


def restore_tree(path: str, target: Any) -> Any:
  """Restores a `save_tree` checkpoint into the structure, shapes and dtypes of `target`.

  Raises: FileNotFoundError if `path` is not a directory; ValueError (from Orbax) when the saved
  tree does not match `target` (e.g. a critic of another model config).
  """
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no checkpoint directory {path}")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  return ocp.StandardCheckpointer().restore(path, abstract)


def latest_complete(run_dir: str) -> int | None:
  """The highest complete checkpoint step of a run dir without opening a manager (a driver's "is this
  stage done" test; Orbax renames a step's temporary directory to the bare step number only once the
  save is complete), or None without one."""
  ckpts = os.path.join(run_dir, "checkpoints")
  steps = [int(n) for n in os.listdir(ckpts) if n.isdigit()] if os.path.isdir(ckpts) else []
  return max(steps) if steps else None


def reached(run_dir: str, step: int) -> bool:
  """True when the run dir holds a complete checkpoint at `step` or later (a finished stage)."""
  latest = latest_complete(run_dir)
  return latest is not None and latest >= step
