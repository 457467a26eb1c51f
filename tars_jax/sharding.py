"""Device mesh and logical-axis sharding: the only module that knows the mesh axes.

Parameters carry logical axis names in their nnx metadata (`out_sharding`, e.g. ("expert", "embed",
"mlp") for an expert's gate weights; see `param_axes`); activations are annotated in model code with
`constrain(x, ("act_batch", "act_length", "act_embed"))`. A rule table maps each logical name to
none, one or several of the mesh axes `MESH_AXES = (data, fsdp, tensor, expert)`; the defaults
(`DEFAULT_RULES`) can be overridden per name from the config (`config.mesh.rules`).

Rule semantics (as maxtext's `logical_axis_rules`, AI-Hypercomputer/maxtext `configs/base.yml`, and
flax's `logical_to_mesh_axes`): a logical name maps to a tuple of mesh axes; within one array a mesh
axis is used by the first dimension that asks for it (later dimensions drop it). Parameters must be
divisible by the mesh axes their rule names (else `ShardingError` naming the rule, axis and
dimension); activations drop, from the end of their axis tuple, the mesh axes that do not divide
(e.g. a batch of 1 while decoding stays replicated).

  mesh = make_mesh((2, 1, 2, 2))                       # data, fsdp, tensor, expert
  rules = make_rules({"embed": None})                  # defaults, with embed replicated
  graphdef, state = sharded_init(lambda: Policy(cfg, nnx.Rngs(0)), mesh, rules)
  with activate(mesh, rules):                          # activation constraints while tracing
    loss = jax.jit(loss_fn)(state, batch)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical name -> mesh axes (None = replicated). Parameter names first, then activations ("act_*").
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    # parameters: FSDP over the model width, tensor parallelism over heads / MLP width / vocabulary,
    # expert parallelism over the expert axis.
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("vision_embed", "fsdp"),
    ("vision_heads", "tensor"),
    ("vision_mlp", "tensor"),
    ("patch", None),
    ("pos", None),
    ("norm", None),
    ("layers", None),
    # activations: the batch over every data-like axis; model width replicated (Megatron style).
    ("act_batch", ("data", "fsdp", "expert")),
    ("act_length", None),
    ("act_embed", None),
    ("act_vocab", "tensor"),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_expert", "expert"),
    ("act_exp_tokens", ("data", "fsdp")),  # token axis of arrays that are also split over experts
)


class ShardingError(ValueError):
  """A mesh or rule does not fit: a mesh axis that does not divide a dimension (names the rule, the
  mesh axis and the dimension), an unknown logical name or mesh axis, or a wrong device count."""


def axes_of(entry) -> tuple[str, ...]:
  """Mesh axes of a rule value or PartitionSpec entry: None -> (), "a" -> ("a",), ("a", "b") -> itself."""
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def make_rules(overrides: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
               base: Sequence[tuple[str, Any]] = DEFAULT_RULES) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """`base` rules with some names re-mapped: overrides {logical: None | axis | (axes...)} (a dict,
  ConfigDict or (name, axes) pairs; a new name is appended). Returns a tuple of
  (logical name, tuple of mesh axes). Raises ShardingError for an unknown mesh axis."""
  if overrides is None:
    overrides = {}
  if hasattr(overrides, "to_dict"):
    overrides = overrides.to_dict()
  over = dict(overrides.items() if isinstance(overrides, Mapping) else overrides)
  table = dict(base)
  table.update(over)
  out = []
  for name, axes in table.items():
    axes = axes_of(axes)
    for a in axes:
      if a not in MESH_AXES:
        raise ShardingError(f"rule {name!r} -> {axes}: unknown mesh axis {a!r}; mesh axes are {MESH_AXES}")
    out.append((name, axes))
  return tuple(out)


def make_mesh(shape: Sequence[int], axes: Sequence[str] = MESH_AXES, devices=None) -> Mesh:
  """A `Mesh` of `shape` (one size per axis of `axes`) over `devices` (default: all devices).

  Raises ShardingError if len(shape) != len(axes), an axis is not one of `MESH_AXES`, or
  prod(shape) != the number of devices.
  """
  shape, axes = tuple(int(s) for s in shape), tuple(axes)
  if len(shape) != len(axes):
    raise ShardingError(f"mesh shape {shape} has {len(shape)} sizes for {len(axes)} axes {axes}")
  for a in axes:
    if a not in MESH_AXES:
      raise ShardingError(f"unknown mesh axis {a!r}; mesh axes are {MESH_AXES}")
  devices = list(jax.devices() if devices is None else devices)
  if math.prod(shape) != len(devices):
    raise ShardingError(f"mesh shape {shape} needs {math.prod(shape)} devices, have {len(devices)}")
  return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes), devices=devices)


def mesh_from_config(mesh_cfg) -> Mesh | None:
  """`config.mesh` (fields `shape`: tuple of 4 ints, or () / None for no mesh) -> Mesh or None."""
  shape = None if mesh_cfg is None else mesh_cfg.get("shape")
  if not shape:
    return None
  return make_mesh(tuple(shape))


def rules_from_config(mesh_cfg) -> tuple:
  """`config.mesh.rules` (a dict of overrides, may be absent) merged into `DEFAULT_RULES`."""
  return make_rules(None if mesh_cfg is None else mesh_cfg.get("rules"))


def param_axes(*names: str | None) -> dict:
  """nnx Variable metadata naming the logical axes of a parameter: `nnx.Param(x, **param_axes("embed",
  "mlp"))` or `nnx.Linear(..., kernel_metadata=param_axes(...))`. (`eager_sharding=False`: the
  model is built without a mesh; placement is `logical_to_sharding`'s job.)"""
  return {"out_sharding": tuple(names), "eager_sharding": False}


def _spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules, strict: bool,
          what: str = "") -> PartitionSpec:
  """PartitionSpec of an array of `shape` whose dimensions have logical `names`."""
  table = dict(rules)
  if len(names) != len(shape):
    raise ShardingError(f"{what}: {len(names)} logical axes {tuple(names)} for shape {tuple(shape)}")
  used: set[str] = set()
  out = []
  for dim, (name, size) in enumerate(zip(names, shape)):
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise ShardingError(f"{what}: logical axis {name!r} has no rule; known: {sorted(table)}")
    axes = [a for a in table[name] if a in mesh.shape and a not in used]
    if strict:
      for a in axes:
        if size % mesh.shape[a]:
          raise ShardingError(f"{what}: rule {name!r} -> {table[name]}: mesh axis {a!r} of size "
                              f"{mesh.shape[a]} does not divide dimension {dim} of size {size} "
                              f"(shape {tuple(shape)})")
    while axes and size % math.prod(mesh.shape[a] for a in axes):
      axes.pop()  # activations: the largest prefix of the axes that divides
    used.update(axes)
    out.append(None if not axes else (axes[0] if len(axes) == 1 else tuple(axes)))
  return PartitionSpec(*out)


def logical_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules,
                 what: str = "array") -> PartitionSpec:
  """Mesh PartitionSpec of a parameter with logical `names` and `shape` (strict divisibility).

  Raises ShardingError naming the rule, the mesh axis and the dimension when a mesh axis does not
  divide it, or for an unknown logical name.
  """
  return _spec(names, shape, mesh, rules, strict=True, what=what)


def _var_names(v) -> tuple | None:
  names = v.get_metadata().get("out_sharding")
  return None if names is None else tuple(names)


def logical_to_sharding(tree: Any, mesh: Mesh, rules=None) -> Any:
  """The NamedSharding of every leaf of `tree` (an nnx.State / Module state, abstract or concrete,
  or a pytree holding them such as an optax state): Variables with logical axis names
  (`out_sharding` metadata) by the rules, everything else replicated. Same structure as `tree`
  (usable as `jax.jit(out_shardings=...)` / `jax.device_put` target). Raises ShardingError (see
  `logical_spec`), naming the variable's path."""
  rules = make_rules() if rules is None else rules

  def one(path, x):
    what = jax.tree_util.keystr(path)
    if isinstance(x, nnx.Variable):
      names = _var_names(x)
      spec = PartitionSpec() if names is None else logical_spec(names, x.shape, mesh, rules, what)
      return x.replace(NamedSharding(mesh, spec))
    if hasattr(x, "shape"):
      return NamedSharding(mesh, PartitionSpec())
    return x

  return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard(tree: Any, mesh: Mesh, rules=None) -> Any:
  """`tree` (concrete) placed on `mesh` as `logical_to_sharding` says (a copy per device shard)."""
  return jax.device_put(tree, logical_to_sharding(tree, mesh, rules))


def committed(tree: Any) -> Any:
  """`tree` with every uncommitted jax.Array leaf committed: next to the tree's committed leaves
  (replicated over their mesh for a `NamedSharding`), on the default device when none is.

  jax.jit keys its compiled programs on whether each argument is committed, and the outputs of a
  jitted step always are. A train state fresh from `jnp.zeros` / `optax.init` (step counts) went into
  the first update uncommitted and came out committed, so the first update compiled its step twice
  (benchmarks/RESULTS.md, "The main job's RL stage: one compilation of the first update").
  Under tracing (`jax.jit`, `jax.eval_shape`) the tree is returned unchanged.
  """
  arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  if any(isinstance(x, jax.core.Tracer) for x in arrays):
    return tree  # under jit / eval_shape placement is the caller's; a tracer has no `committed`
  anchor = next((x for x in arrays if x.committed), None)
  if anchor is not None and isinstance(anchor.sharding, NamedSharding):
    target = NamedSharding(anchor.sharding.mesh, PartitionSpec())
  else:
    device = next(iter(anchor.sharding.device_set)) if anchor is not None else jax.devices()[0]
    target = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.device_put(x, target) if isinstance(x, jax.Array) and not x.committed
                      else x, tree)


def sharded_init(make_model: Callable[[], nnx.Module], mesh: Mesh, rules=None):
  """(graphdef, state) of `make_model()` created directly in its sharded layout: the shapes come
  from `nnx.eval_shape`, the shardings from the rules, and the initialisers run under
  `jax.jit(out_shardings=...)`, so each device only materialises its own shards (big_vision /
  flax "sharded init"). Values equal an unsharded jitted init of the same function."""
  abstract = nnx.eval_shape(make_model)
  graphdef, abs_state = nnx.split(abstract)
  shardings = logical_to_sharding(abs_state, mesh, rules)

  def init():
    return nnx.split(make_model())[1]

  return graphdef, jax.jit(init, out_shardings=shardings)()


# --- activation constraints --------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("tars_jax_sharding", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh | None, rules=None):
  """Within this context (while jitted functions are traced), `constrain` pins activations to
  `mesh` by `rules`. `mesh=None`: no constraints (the single-device default)."""
  token = _ACTIVE.set(None if mesh is None else (mesh, make_rules() if rules is None else rules))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active() -> tuple[Mesh, tuple] | None:
  """(mesh, rules) of the enclosing `activate(mesh, ...)` context, or None (no mesh)."""
  return _ACTIVE.get()


def activation_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules) -> PartitionSpec:
  """Mesh PartitionSpec of an activation with logical `names` and `shape`: as `logical_spec`, but a
  dimension keeps only the longest prefix of its rule's mesh axes that divides it (no error)."""
  return _spec(names, shape, mesh, rules, strict=False, what="activation")


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`jax.lax.with_sharding_constraint(x, <spec of names>)` under an `activate` context, else x
  unchanged. Mesh axes that do not divide a dimension are dropped for that dimension."""
  cur = _ACTIVE.get()
  if cur is None:
    return x
  mesh, rules = cur
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, activation_spec(names, x.shape, mesh, rules)))


def describe(state: Any) -> dict[str, tuple]:
  """{path: (shape, PartitionSpec, shape of device 0's shard)} of every array in `state` (for
  logs and tests)."""
  out = {}
  leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  for path, x in leaves:
    x = x.value if isinstance(x, nnx.Variable) else x
    if hasattr(x, "sharding"):
      out[jax.tree_util.keystr(path)] = (tuple(x.shape), getattr(x.sharding, "spec", None),
                                         tuple(x.addressable_shards[0].data.shape))
  return out


def mesh_shape(mesh: Mesh | None) -> tuple[int, ...]:
  """(data, fsdp, tensor, expert) sizes of `mesh` (1 for absent axes); () for no mesh."""
  if mesh is None:
    return ()
  return tuple(int(mesh.shape.get(a, 1)) for a in MESH_AXES)


__all__ = ["MESH_AXES", "DEFAULT_RULES", "ShardingError", "make_rules", "make_mesh", "mesh_from_config",
           "rules_from_config", "param_axes", "logical_spec", "logical_to_sharding", "shard", "sharded_init",
           "activate", "active", "activation_spec", "axes_of", "constrain", "describe", "mesh_shape"]
