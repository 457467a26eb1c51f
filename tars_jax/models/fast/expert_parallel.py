"""Expert parallelism with an explicit all-to-all dispatch (`ModelConfig.moe_dispatch = "all_to_all"`).

Under GSPMD alone (`moe_dispatch = "gspmd"`) the compiler decides how the sorted token groups meet the
expert-sharded weights; for `ragged_dot` it may all-gather the experts instead of moving the tokens.
Here the exchange is written out (GShard, Lepikhin et al. 2021, section 2.2; maxtext
`MaxText/layers/moe.py` `sparse_matmul` under `shard_map`), in one `jax.shard_map` over every mesh axis:

  1. each token shard sorts its N_l * k (token, expert) assignments by expert; the expert's owner is
     the shard `expert // E_l` of the `expert` mesh axis (E_l = E / P experts per shard, P its size);
  2. it packs the rows for each owner into a send buffer [P, C, D] (dropless: C = N_l * k, the most one
     owner can get; with a capacity factor c = ceil(factor * N_l * k / E) rows per expert and source
     shard, C = E_l * c, the later tokens beyond c dropped and counted);
  3. `all_to_all` over `expert`: each shard now holds the rows sent to its experts by every source;
  4. its E_l experts run on them (`ragged_dot` over rows grouped by local expert; weights sharded over
     `embed` (FSDP) are all-gathered, the `mlp` (tensor) partial sums are `psum`med);
  5. `all_to_all` back, and each source combines its rows with the routing weights.

Exact and dropless without a capacity factor (the same outputs and gradients as one device, tested on
8 simulated CPU devices). Fixed buffer sizes are the price of `all_to_all` on every backend: the
dropless send buffer holds P * N_l * k rows, P times the rows that carry data. XLA:CPU has no
`ragged_all_to_all` (jax 0.10.2: "not supported by XLA:CPU ThunkEmitter"), which would send only the
rows that exist.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from tars_jax import sharding
from tars_jax.models.moe import combine, ragged_swiglu, rank_in_group, sort_by_expert
from tars_jax.sharding import axes_of as _axes

EXPERT_AXIS = "expert"


def token_axes(num_tokens: int, mesh: Mesh, rules) -> tuple[str, ...]:
  """Mesh axes that split N = `num_tokens` routed tokens: the batch rule's ("act_batch") axes, the
  longest prefix of them that divides N, as for any activation (default: data, fsdp, expert)."""
  return _axes(sharding.activation_spec(("act_batch",), (num_tokens,), mesh, rules)[0])


def applies(mesh: Mesh | None, rules, num_experts: int, num_tokens: int) -> bool:
  """True iff the all-to-all dispatch has something to do: a mesh whose `expert` axis has size > 1, a
  rule that shards the logical "expert" axis over exactly that mesh axis, and N = `num_tokens` split
  over it and over the weights' "embed" axes (`token_axes`). Otherwise (e.g. decoding one sequence:
  N = 1 is split over nothing) the tokens are replicated over the expert shards, there is nothing to
  exchange, and the caller runs the single-shard path under GSPMD."""
  if mesh is None or mesh.shape.get(EXPERT_AXIS, 1) == 1:
    return False
  spec = sharding.logical_spec(("expert", "embed"), (num_experts, 0), mesh, rules, what="MoE experts")
  tok = token_axes(num_tokens, mesh, rules)
  return _axes(spec[0]) == (EXPERT_AXIS,) and EXPERT_AXIS in tok and set(_axes(spec[1])) <= set(tok)


def moe_all_to_all(flat: jax.Array, w: jax.Array, idx: jax.Array, wgu: jax.Array, wd: jax.Array,
                   mesh: Mesh, rules, capacity_factor: float | None = None):
  """The MoE MLP of routed tokens with expert-parallel all-to-all dispatch.

  Args:
    flat: [N, D] tokens (any float dtype; the compute dtype is wgu's).
    w: [N, k] float32 routing weights; idx: [N, k] int32 experts (from `moe.route`).
    wgu: [E, D, 2, I] gate|up weights, wd: [E, I, D] down weights (logical axes ("expert", "embed",
      None, "mlp") / ("expert", "mlp", "embed"), sharded as `rules` say).
    mesh, rules: the active mesh and rule table (`sharding.activate`), for which `applies(mesh, rules,
      E, N)` holds.
    capacity_factor: None = dropless; else each source shard sends each expert at most
      ceil(factor * N_l * k / E) assignments (N_l its tokens), later tokens dropped first.
  Returns: (y [N, D] in wgu's dtype: sum over the k experts of weight * SwiGLU expert output;
    dropped: float32 scalar, assignments dropped over capacity (0 when dropless)).
  Raises: ShardingError when the "mlp" rule's mesh axes also split the tokens (their partial sums
    would mix different tokens), or for rules that do not divide the weights.
  """
  n, d = flat.shape
  k = idx.shape[1]
  e = wgu.shape[0]
  gu_spec = sharding.logical_spec(("expert", "embed", None, "mlp"), wgu.shape, mesh, rules, what="MoE w_gate_up")
  down_spec = sharding.logical_spec(("expert", "mlp", "embed"), wd.shape, mesh, rules, what="MoE w_down")
  tok = token_axes(n, mesh, rules)  # a mesh axis outside: the tokens replicated over it
  embed_axes, mlp_axes = _axes(gu_spec[1]), _axes(gu_spec[3])  # size-1 axes too: shard_map types them
  if set(mlp_axes) & set(tok):
    raise sharding.ShardingError(
        f"moe_dispatch='all_to_all': the 'mlp' rule's mesh axes {mlp_axes} also split the tokens "
        f"({tok}); map 'mlp' to axes outside the batch rule")
  p = mesh.shape[EXPERT_AXIS]
  e_l = e // p
  n_l = n // math.prod(mesh.shape[a] for a in tok)
  g = n_l * k
  c_e = None if capacity_factor is None else max(1, math.ceil(capacity_factor * g / e))
  c = g if c_e is None else e_l * c_e  # rows per (source, owner) pair
  tok_spec = P(tok if tok else None)

  def body(x, w, idx, wgu, wd):
    if embed_axes:  # FSDP: the full model width of this shard's experts
      wgu = jax.lax.all_gather(wgu, embed_axes, axis=1, tiled=True)
      wd = jax.lax.all_gather(wd, embed_axes, axis=2, tiled=True)
    dt = wgu.dtype
    order, sorted_e, sizes = sort_by_expert(idx, e)  # [g] assignments by global expert
    owner = sorted_e // e_l
    if c_e is None:  # dropless: packed per owner
      pos = rank_in_group(owner, sizes.reshape(p, e_l).sum(1))
      keep = jnp.ones((g,), bool)
    else:  # c_e rows per expert: row (local expert, rank) of the owner's block
      rank = rank_in_group(sorted_e, sizes)
      keep = rank < c_e
      pos = (sorted_e % e_l) * c_e + rank
    slot = jnp.where(keep, owner * c + pos, p * c)  # dropped -> a spare row, cut off below
    send = jnp.zeros((p * c + 1, d), dt).at[slot].set(x[order // k].astype(dt))[:-1].reshape(p, c, d)
    # local expert id of each row; e_l marks an empty row (sorted last, outside every group)
    send_e = jnp.full((p * c + 1,), e_l, jnp.int32).at[slot].set(sorted_e % e_l)[:-1].reshape(p, c)
    recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=True).reshape(p * c, d)
    recv_e = jax.lax.all_to_all(send_e, EXPERT_AXIS, 0, 0, tiled=True).reshape(p * c)
    y = _local_experts(recv, recv_e, wgu, wd, e_l)
    if mlp_axes:  # tensor parallelism: each shard summed over its slice of the expert width
      y = jax.lax.psum(y, mlp_axes)
    back = jax.lax.all_to_all(y.reshape(p, c, d), EXPERT_AXIS, 0, 0, tiled=True).reshape(p * c, d)
    ys = jnp.where(keep[:, None], back[jnp.minimum(slot, p * c - 1)], 0)  # [g, D] in sorted order
    out = combine(ys, order, w, dt)
    dropped = jnp.sum(~keep).astype(jnp.float32)
    return out, (jax.lax.psum(dropped, tok) if tok else dropped)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(tok_spec, tok_spec, tok_spec, gu_spec, down_spec),
                     out_specs=(tok_spec, P()))
  return fn(flat, w, idx, wgu, wd)


def _local_experts(x: jax.Array, ids: jax.Array, wgu: jax.Array, wd: jax.Array, e_l: int) -> jax.Array:
  """SwiGLU experts on rows: x [R, D], ids [R] int32 local expert of each row (e_l = empty row),
  wgu [e_l, D, 2, I], wd [e_l, I, D] -> [R, D] (0 for empty rows), via `jax.lax.ragged_dot` over the
  rows sorted by expert."""
  order, sorted_ids, sizes = sort_by_expert(ids[:, None], e_l)  # empty rows (id e_l): last, in no group
  ys = ragged_swiglu(x[order], sizes, wgu, wd)
  ys = jnp.where((sorted_ids < e_l)[:, None], ys, 0)  # rows outside every group: zero, whatever ragged_dot left
  return jnp.zeros_like(ys).at[order].set(ys)
