"""Mixture-of-Experts MLP (Qwen3-MoE structure): softmax top-k router, SwiGLU experts,
switch-style load-balance loss (transformers `load_balancing_loss_func`)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax import sharding
from tars_jax.models import expert_kernel
from tars_jax.models.config import ModelConfig
from tars_jax.models.grouped_mlp import grouped_swiglu
from tars_jax.sharding import constrain, param_axes as ax


def route(router_logits: jax.Array, top_k: int, norm_topk_prob: bool):
  """Softmax top-k router (transformers `Qwen3VLMoeTextTopKRouter`).

  Args: router_logits [N, E]. Returns (probs [N, E] float32, weights [N, k] float32, indices [N, k]
  int32); with `norm_topk_prob` the k weights are renormalised to sum to 1. Ties pick the lower index.
  """
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  w, idx = jax.lax.top_k(probs, top_k)
  if norm_topk_prob:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
  return probs, w, idx


def load_balance_loss(probs: jax.Array, idx: jax.Array, num_experts: int,
                      mask: jax.Array | None = None) -> jax.Array:
  """Switch-Transformer load-balance loss, E * sum_e f_e * P_e, as transformers
  `load_balancing_loss_func` (Fedus et al. 2021, eqs. 4-6).

  Args:
    probs: [L, N, E] or [N, E] router probabilities of L MoE layers (pooled over layers as
      transformers concatenates them, not averaged per layer).
    idx: [L, N, k] or [N, k] selected experts.
    mask: None or [N] (1 = real token), the same for every layer.
  f_e = (top-k assignments to e) / (tokens), P_e = mean router probability of e, both over masked
  tokens of all layers; sum_e f_e = k. Returns a float32 scalar (1 * k for a perfectly uniform router).
  """
  if probs.ndim == 2:
    probs, idx = probs[None], idx[None]
  m = jnp.ones(probs.shape[1], jnp.float32) if mask is None else mask.astype(jnp.float32)
  rows = jnp.maximum(m.sum() * probs.shape[0], 1.0)
  counts = jnp.einsum("lnke,n->e", jax.nn.one_hot(idx, num_experts, dtype=jnp.float32), m)
  prob_sum = jnp.einsum("lne,n->e", probs.astype(jnp.float32), m)
  return num_experts * jnp.sum((counts / rows) * (prob_sum / rows))


def sort_by_expert(idx: jax.Array, num_experts: int):
  """Groups the N*k (token, slot) assignments of idx [N, k] by expert (stable: ties keep token order).

  Returns (order [N*k] int32: assignment ids (token * k + slot) sorted by expert, sorted_experts [N*k],
  group_sizes [E] int32). Source: maxtext `MaxText/layers/moe.py` `permute` (sort + bincount).
  """
  flat = idx.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  return order, flat[order], jnp.bincount(flat, length=num_experts).astype(jnp.int32)


# Smallest block worth gathering its expert's weights for: below ~64 rows per expert on average the
# dense all-experts einsum is faster on CPU (one MoE layer, hidden 256, 8 experts top-2, XLA:CPU,
# 2026-11-23: blocked / dense time 2.5x at 16 tokens, 1.3x at 144, 0.8x at 576).
MIN_BLOCK_ROWS = 64
# Between per-token gathers and blocks (e.g. decode at batch 16): an [E, C, D] buffer of
# C = ceil(DECODE_CAPACITY * N * k / E) rows per expert when every expert's load fits, else dense.
DECODE_CAPACITY = 2.0
# Rows per chunk of the "grouped" path's loop (at most; smaller when block_rows says so).
GROUPED_ROWS = 128


def rank_in_group(sorted_e: jax.Array, sizes: jax.Array) -> jax.Array:
  """[N*k] int32: the position of each sorted assignment within its expert's group (0, 1, ...), from
  `sort_by_expert`'s sorted_experts [N*k] and group_sizes [E]."""
  start = jnp.cumsum(sizes) - sizes  # first sorted position of each expert's group
  return jnp.arange(sorted_e.shape[0], dtype=jnp.int32) - start[sorted_e]


def block_rows(assignments: int, num_experts: int) -> int:
  """Rows per block of the "blocked" MoE path for `assignments` = N * k (token, expert) pairs: 1 (a
  per-token gather of its k experts' weights: decode) while there are at most as many assignments as
  experts; 0 (= compute densely) while N * k / E < `MIN_BLOCK_ROWS`; else the power of two nearest
  N * k / E (about one block per expert on average: prefill and training batches). Static: chosen at
  trace time from shapes."""
  if assignments <= num_experts:
    return 1
  if assignments < MIN_BLOCK_ROWS * num_experts:
    return 0
  return 1 << round(math.log2(assignments / num_experts))


def num_blocks(assignments: int, num_experts: int, rows: int) -> int:
  """Upper bound on sum_e ceil(g_e / rows) over group sizes g_e summing to `assignments`:
  (G + E (rows - 1)) // rows (each group wastes at most rows - 1 padding slots), capped at G."""
  return min(assignments, (assignments + num_experts * (rows - 1)) // rows)


def chunk_table(sizes: jax.Array, rows: int, max_chunks: int):
  """The blocks of R = `rows` rows covering each expert's group, in expert order (the "blocked" path's
  block -> expert map).

  Args: sizes [E] int32 group sizes (sum G); max_chunks: a static bound on sum_e ceil(g_e / R)
    (`num_blocks(G, E, R)`).
  Returns: (count int32 scalar = sum_e ceil(g_e / R), expert [M] int32, start [M] int32 first row in
    the sorted assignments, valid [M] int32 rows of the chunk inside its group (1..R)); entries at
    index >= count are unused.
  """
  n_chunks = -(-sizes // rows)
  end = jnp.cumsum(n_chunks)
  j = jnp.arange(max_chunks, dtype=jnp.int32)
  e = jnp.minimum(jnp.searchsorted(end, j, side="right"), sizes.shape[0] - 1).astype(jnp.int32)
  local = j - (end - n_chunks)[e]
  group_start = jnp.cumsum(sizes) - sizes
  start = group_start[e] + local * rows
  valid = jnp.clip(sizes[e] - local * rows, 0, rows)
  return end[-1].astype(jnp.int32), e, start.astype(jnp.int32), valid.astype(jnp.int32)


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
  """Slots per expert: ceil(factor * N * k / E), at least 1 (GShard / Switch capacity factor)."""
  return max(1, math.ceil(factor * num_tokens * top_k / num_experts))


def swiglu(gate_up: jax.Array, axis: int) -> jax.Array:
  """silu(gate) * up of pre-activations stacked on `axis` (size 2: gate at 0, up at 1), which is removed."""
  gate, up = (jnp.take(gate_up, j, axis=axis) for j in (0, 1))
  return jax.nn.silu(gate) * up


def cast_apply(fn, x: jax.Array, w: jax.Array, *rest: jax.Array, dtype, index=None) -> jax.Array:
  """fn(x, w'.astype(dtype), *rest) with w' = w, or w[index] (int32 index: the blocked path's expert of
  each block), the gather and cast redone in the backward. fn must be linear in each argument (an
  einsum).

  Autodiff of a cast (or gather) outside keeps its result, a copy of the experts' weights (in bf16
  576 MiB per layer of the a3b8 preset, 64 experts of 2048 x 768), from the forward to the backward.
  Under `jax.checkpoint` with nothing saveable only the inputs are kept (w is the float32 parameter,
  alive anyway), and fn is linear in each operand, so the backward recomputes only the cast
  (`benchmarks/RESULTS.md`, 2026-11-26: 15 GiB fewer temporaries in the a3b8 dense bf16 step, 19 GiB in
  the blocked one). Same values and gradients as casting outside; with w already in `dtype` it is
  what autodiff keeps anyway."""
  def f(x, w, *rest):
    return fn(x, (w if index is None else w[index]).astype(dtype), *rest)
  if index is None and w.dtype == dtype:  # nothing to redo: leave XLA's schedule alone
    return f(x, w, *rest)
  return jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)(x, w, *rest)


def cast_einsum(spec: str, x: jax.Array, w: jax.Array, *rest: jax.Array, dtype, index=None) -> jax.Array:
  """jnp.einsum(spec, x, w'.astype(dtype), *rest): `cast_apply` of an einsum."""
  return cast_apply(functools.partial(jnp.einsum, spec), x, w, *rest, dtype=dtype, index=index)


def ragged_swiglu(xs: jax.Array, sizes: jax.Array, wgu: jax.Array, wd: jax.Array) -> jax.Array:
  """SwiGLU experts on contiguous groups (`jax.lax.ragged_dot`): xs [G, D] sorted by expert, sizes [E]
  int32 group sizes, wgu [E, D, 2, I], wd [E, I, D] (in the compute dtype) -> [G, D] (rows past
  sum(sizes) belong to no group). The weights are cast outside: `cast_apply` around the three
  ragged_dots made the a3b8 bf16 step's XLA:CPU temporaries larger (99.5 -> 106.5 GiB)."""
  h = jax.nn.silu(jax.lax.ragged_dot(xs, wgu[:, :, 0], sizes)) * jax.lax.ragged_dot(xs, wgu[:, :, 1], sizes)
  return jax.lax.ragged_dot(h, wd, sizes)


def capacity_swiglu(buf: jax.Array, wgu: jax.Array, wd: jax.Array, groups: int = 1) -> jax.Array:
  """SwiGLU of each expert on its rows of an [E, C, D] buffer: buf [E, C, D], wgu [E, D, 2, I],
  wd [E, I, D] in any dtype (cast to buf's inside, `cast_einsum`) -> [E, C, D] (row c of expert e
  through expert e's weights).

  groups > 1 (a divisor of E): the same products as `groups` independent einsums over contiguous
  expert ranges, concatenated. XLA:CPU runs independent ops on separate cores but a batched matmul of
  a few rows per expert on one; with few rows (decode) the products are bound by streaming the
  weights from memory, which one core does at about half the machine's rate (decode at batch 16:
  one einsum 11-12 GB/s, two halves 17-21 GB/s each; `benchmarks/RESULTS.md`).
  """
  e = buf.shape[0]
  if e % groups:
    raise ValueError(f"groups={groups} does not divide the {e} experts")
  outs = []
  for j in range(groups):
    s = slice(j * e // groups, (j + 1) * e // groups)
    h = swiglu(cast_einsum("ecd,edgi->ecgi", buf[s], wgu[s], dtype=buf.dtype), axis=2)
    outs.append(cast_einsum("eci,eid->ecd", h, wd[s], dtype=buf.dtype))
  return outs[0] if groups == 1 else jnp.concatenate(outs, axis=0)


def decode_expert_groups(num_experts: int) -> int:
  """How many independent einsums `MoE`'s bounded decode path splits its experts into: E (one per
  expert) on XLA:CPU with no mesh active, else 1 (one batched einsum: what an accelerator, and
  GSPMD's expert sharding of the buffer, want). See `capacity_swiglu`."""
  return num_experts if jax.default_backend() == "cpu" and sharding.active() is None else 1


def per_expert_swiglu(buf: jax.Array, gate_up: tuple, down: tuple) -> jax.Array:
  """`capacity_swiglu` with one einsum per expert over weights already split per expert: buf
  [E, C, D], gate_up E arrays [D, 2, I], down E arrays [I, D], all in buf's dtype -> [E, C, D]."""
  h = [swiglu(jnp.einsum("cd,dgi->cgi", buf[j], g), axis=1) for j, g in enumerate(gate_up)]
  return jnp.stack([jnp.einsum("ci,id->cd", hj, d) for hj, d in zip(h, down)])


def decode_kernel_applies(cfg: ModelConfig) -> bool:
  """Whether `cfg`'s MoE layers take the FFI decode kernel in a CPU decode loop, as far as the config
  decides: `moe_decode_kernel`, a path with the bounded decode ("blocked" / "grouped"), and shapes and
  dtype the kernel supports (`expert_kernel.supports`). The loop also needs `expert_kernel.available()`,
  XLA:CPU without a mesh, and unscanned layers (`split_experts_for_decode`)."""
  return (cfg.moe_decode_kernel and cfg.moe_impl in ("blocked", "grouped")
          and expert_kernel.supports(cfg.hidden, cfg.moe_intermediate, cfg.jdtype))


def split_experts_for_decode(model: nnx.Module) -> int:
  """Before a decode loop on XLA:CPU: gives every (unscanned) `MoE` layer of `model` its experts'
  weights in a decode layout, made once and kept out of the loop by an `optimization_barrier`:
    - with the FFI kernel (`cfg.moe_decode_kernel` and `expert_kernel.available()`, float32, D a
      multiple of 16 and I of 8): tile-packed copies (`MoE.decode_packed`) that the kernel streams once
      per step, each expert on exactly its routed rows (batch-16 decode 0.6x the time, RESULTS.md);
    - else E separate arrays in the compute dtype (`MoE.expert_slices`), so the bounded decode path's
      per-expert einsums (`decode_expert_groups`) read them in place. Without it XLA:CPU copies each
      expert's [D, 2, I] and [I, D] slice out of the stacked parameter before its dot at every step (75
      MB per step for the decode benchmark's model, 16 copy fusions per layer; batch-16 decode
      0.88-0.90x the time with the split, RESULTS.md).
  Either costs one more copy of the expert weights while the loop runs. A no-op for the MoE paths
  without the bounded decode path ("dense", "ragged"), where that path uses one batched einsum (a mesh,
  an accelerator), and for scanned layers (stacked [L, E, ...] weights, sliced per layer by the scan
  anyway). Returns how many layers were split or packed.
  Call it inside the jitted function that runs the loop, on a model that function merged.
  """
  n = 0
  for _, mod in nnx.iter_graph(model):
    if (isinstance(mod, MoE) and mod.impl in ("blocked", "grouped") and mod.w_gate_up.ndim == 4
        and decode_expert_groups(mod.experts) == mod.experts):
      gu, dn = mod.w_gate_up[...].astype(mod.dtype), mod.w_down[...].astype(mod.dtype)
      if mod.decode_kernel and expert_kernel.available():
        mod.decode_packed = nnx.data(jax.lax.optimization_barrier(
            (expert_kernel.pack_gate_up(gu), expert_kernel.pack_down(dn))))
      else:
        mod.expert_slices = nnx.data(jax.lax.optimization_barrier(
            (tuple(gu[j] for j in range(mod.experts)), tuple(dn[j] for j in range(mod.experts)))))
      n += 1
  return n


def combine(ys: jax.Array, order: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """ys [N*k, D] in expert-sorted order (`sort_by_expert`'s order [N*k]) -> [N, D]: unsorted and
  summed over each token's k experts, weighted by the routing weights w [N, k] cast to `dtype`."""
  g, d = ys.shape
  n, k = w.shape
  inv = jnp.zeros_like(order).at[order].set(jnp.arange(g, dtype=jnp.int32))  # unsort
  return jnp.einsum("nkd,nk->nd", ys[inv].reshape(n, k, d), w.astype(dtype))


class MoE(nnx.Module):
  """x [B, T, D] -> (y [B, T, D], (probs [B*T, E], indices [B*T, k])) for the aux loss; with a
  capacity factor the tuple has a third entry, the float32 count of dropped assignments.

  Expert weights are stored as `w_gate_up` [E, D, 2, I] (gate at index 0, up at 1: transformers'
  `gate_up_proj` [E, 2I, D] transposed) and `w_down` [E, I, D]; logical axes ("expert", "embed", None,
  "mlp") / ("expert", "mlp", "embed"). Gate and up in one parameter: the CPU training path runs them as
  one [D, 2I] matmul (a free reshape, no per-step concatenation or gradient split: 2-4 % of the train
  step, RESULTS.md), and the size-2 axis apart from I keeps I shardable over `tensor` (gate and up
  columns of a shard stay together). `cfg.moe_impl` picks the computation:
    "dense": every token through every expert, weighted by the (sparse, top-k) routing weights:
      exact, jittable, E/k times the useful FLOPs (fine at small scale);
    "ragged": the N*k assignments sorted by expert (`sort_by_expert`), each expert applied to its
      contiguous group with `jax.lax.ragged_dot` (dropless), outputs unsorted and combined with the
      routing weights. With `cfg.moe_capacity_factor` set, the sorted tokens instead fill an
      [E, C, D] buffer (C = `capacity(...)`), assignments beyond an expert's C slots (later tokens
      first) are dropped (contribute 0) and counted; the buffer's expert
      axis is sharded over the `expert` mesh axis (expert parallelism through GSPMD). With
      `cfg.moe_dispatch = "all_to_all"` under a mesh with an `expert` axis the assignments are sent to
      their experts' shards and back with explicit `all_to_all`s instead (`expert_parallel.py`);
    "blocked": the sorted assignments padded per expert to whole blocks of `block_rows` rows, so each
      block belongs to one expert; a batched matmul over the blocks with the block's expert weights
      gathered ([nb, D, I]). Dropless and exact like "ragged", but plain dot_generals, which XLA:CPU
      runs far faster than `ragged_dot`; at decode (N * k <= E, blocks of 1 row) it reads only each
      token's k experts instead of all E (the dense path's cost), hence the faster greedy decode in
      `benchmarks/decode.py`; between the two (fewer than `MIN_BLOCK_ROWS` rows per expert, e.g.
      decode at batch 16) an [E, C, D] buffer of C = `capacity(N, k, E, DECODE_CAPACITY)` rows when
      every expert's load fits, else the dense path (`lax.cond`; exact either way). MegaBlocks'
      block-sparse grouping (Gale et al. 2022) without custom kernels.
    "grouped": "blocked" for decode and few rows per expert; from `MIN_BLOCK_ROWS` rows per expert a
      loop over experts and the chunks of `GROUPED_ROWS`, then halving down to 16 rows, that each group
      needs, weights indexed once per expert, with a custom VJP (`grouped_mlp.grouped_swiglu`): exact like the
      others, without "blocked"'s static block bound (3840 computed rows for 2048 assignments in
      `benchmarks/train_step.py`) or its per-block weight gathers.
  On XLA:CPU without a mesh, in float32, two C++ kernels take the experts (`expert_kernel.py`): the
  "grouped" loop runs as OpenBLAS custom calls forward and backward (`cfg.moe_grouped_blas`), and the
  sampler's decode loop ("blocked" / "grouped") streams tile-packed weights (`cfg.moe_decode_kernel`).
  Source: maxtext `MaxText/layers/moe.py` (`sparse_matmul` with `ragged_dot`, `dense_matmul` with
  capacity); Fedus et al. 2021 (capacity factor).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, i, e = cfg.hidden, cfg.moe_intermediate, cfg.experts
    self.top_k, self.norm_topk_prob, self.experts = cfg.top_k, cfg.norm_topk_prob, e
    self.dtype = cfg.jdtype
    self.impl, self.capacity_factor, self.dispatch = cfg.moe_impl, cfg.moe_capacity_factor, cfg.moe_dispatch
    # fan-in = D for gate/up, I for down (the default lecun_normal would take the expert axis).
    init_in = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                   batch_axis=(0,))
    self.router = nnx.Linear(d, e, use_bias=False, dtype=jnp.float32, rngs=rngs, kernel_metadata=ax("embed", None))
    self.w_gate_up = nnx.Param(init_in(rngs.params(), (e, d, 2 * i)).reshape(e, d, 2, i),
                               **ax("expert", "embed", None, "mlp"))
    self.w_down = nnx.Param(init_in(rngs.params(), (e, i, d)), **ax("expert", "mlp", "embed"))
    self.decode_kernel = decode_kernel_applies(cfg)
    self.grouped_blas = cfg.moe_grouped_blas
    # During a CPU decode loop (`split_experts_for_decode`): per-expert weights, or the kernel's packing.
    self.expert_slices = None
    self.decode_packed = None

  def __call__(self, x: jax.Array):
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    probs, w, idx = route(self.router(flat), self.top_k, self.norm_topk_prob)
    if self.impl == "dense":
      return self._dense(flat, w, idx).reshape(b, t, d), (probs, idx)
    if self.impl in ("blocked", "grouped"):
      n, rows = b * t, block_rows(b * t * self.top_k, self.experts)
      if self.decode_packed is not None:  # a CPU decode loop with the FFI kernel: any N, dropless
        y = self._kernel_experts(flat, w, idx)
      elif rows > 1 and self.impl == "grouped":
        y = self._grouped_loop(flat, w, idx, min(rows, GROUPED_ROWS))
      elif rows:
        y = self._blocked(flat, w, idx, rows)
      elif capacity(n, self.top_k, self.experts, DECODE_CAPACITY) < n:  # too few rows per expert for blocks
        y = self._bounded(flat, w, idx)
      else:  # a buffer of C >= N rows per expert is no smaller than the dense path
        y = self._dense(flat, w, idx)
      return y.reshape(b, t, d), (probs, idx)
    from tars_jax.models import expert_parallel  # here, not at the top: it imports this module's helpers
    mesh_rules = sharding.active() if self.dispatch == "all_to_all" else None
    if mesh_rules and expert_parallel.applies(*mesh_rules, self.experts, b * t):
      y, dropped = expert_parallel.moe_all_to_all(flat, w, idx, *self._weights(), *mesh_rules,
                                                  capacity_factor=self.capacity_factor)
      dropped = None if self.capacity_factor is None else dropped
    else:
      y, dropped = self._grouped(flat, w, idx)
    return y.reshape(b, t, d), ((probs, idx) if dropped is None else (probs, idx, dropped))

  def _dense(self, flat, w, idx):
    dense_w = jnp.sum(jax.nn.one_hot(idx, self.experts, dtype=jnp.float32) * w[..., None], axis=1)  # [N, E]
    dt = self.dtype
    h = swiglu(cast_einsum("nd,edgi->negi", flat, self.w_gate_up[...], dtype=dt), axis=2)
    h = constrain(h, ("act_exp_tokens", "act_expert", "act_mlp"))
    return cast_einsum("nei,eid,ne->nd", h, self.w_down[...], dense_w.astype(dt), dtype=dt)

  def _blocked(self, flat, w, idx, rows: int):
    n, d = flat.shape
    k, e, dt = self.top_k, self.experts, self.dtype
    g = n * k
    nb = num_blocks(g, e, rows)
    order, sorted_e, sizes = sort_by_expert(idx, e)
    padded = -(-sizes // rows) * rows  # each expert's group rounded up to whole blocks
    pend = jnp.cumsum(padded)
    pos = (pend - padded)[sorted_e] + rank_in_group(sorted_e, sizes)  # padded row of each assignment (< nb * rows)
    xs = jnp.zeros((nb * rows, d), dt).at[pos].set(flat[order // k].astype(dt)).reshape(nb, rows, d)
    # expert of each block (unused tail blocks: zeros through the last expert, never read back)
    _, block_e, _, _ = chunk_table(sizes, rows, nb)
    h = swiglu(cast_einsum("brd,bdgi->brgi", xs, self.w_gate_up[...], dtype=dt, index=block_e), axis=2)
    ys = cast_einsum("bri,bid->brd", h, self.w_down[...], dtype=dt, index=block_e)
    ys = ys.reshape(nb * rows, d)[pos]  # [N*k, D], sorted order
    return self._combine(ys, order, w)

  def _grouped_loop(self, flat, w, idx, rows: int):
    """The "grouped" path: exact per-expert groups, on OpenBLAS where `_blas_applies` (one custom call
    forward, one backward: `expert_kernel.grouped_swiglu`), else in chunks of `rows` in an XLA loop
    (`grouped_mlp.grouped_swiglu`)."""
    k, e, dt = self.top_k, self.experts, self.dtype
    order, _, sizes = sort_by_expert(idx, e)
    xs = flat[order // k].astype(dt)
    if self._blas_applies():
      ys = expert_kernel.grouped_swiglu(xs, sizes, self.w_gate_up[...], self.w_down[...])
    else:
      ys = grouped_swiglu(xs, sizes, self.w_gate_up[...], self.w_down[...], rows)  # cast per expert inside
    return self._combine(ys, order, w)

  def _grouped(self, flat, w, idx):
    n, _ = flat.shape
    k, e = self.top_k, self.experts
    order, sorted_e, sizes = sort_by_expert(idx, e)
    xs = flat[order // k]  # [N*k, D]: token of each assignment, grouped by expert
    dropped = None
    if self.capacity_factor is None:
      xs = constrain(xs, ("act_exp_tokens", "act_embed"))
      ys = ragged_swiglu(xs, sizes, *self._weights())  # [N*k, D]
    else:
      ys, keep = self._capacity_mlp(xs, sorted_e, sizes, capacity(n, k, e, self.capacity_factor))
      dropped = jnp.sum(~keep).astype(jnp.float32)
    return self._combine(ys, order, w), dropped

  def _capacity_mlp(self, xs, sorted_e, sizes, c: int, groups: int = 1):
    """Experts over an [E, C, D] buffer: xs [N*k, D] sorted by expert -> (ys [N*k, D] in the same
    order, 0 for dropped assignments; keep [N*k] bool: within its expert's first C). `groups`: see
    `capacity_swiglu`."""
    g, d = xs.shape
    e, dt = self.experts, self.dtype
    rank = rank_in_group(sorted_e, sizes)
    keep = rank < c
    slot = jnp.where(keep, sorted_e * c + rank, e * c)  # dropped -> a spare row, cut off below
    buf = jnp.zeros((e * c + 1, d), dt).at[slot].set(xs.astype(dt))[:-1].reshape(e, c, d)
    buf = constrain(buf, ("act_expert", None, "act_embed"))  # the dispatch: [E, C, D] over experts
    if self.expert_slices is not None and groups == e:
      yb = per_expert_swiglu(buf, *self.expert_slices)
    else:
      yb = capacity_swiglu(buf, self.w_gate_up[...], self.w_down[...], groups)  # weights cast inside
    yb = constrain(yb, ("act_expert", None, "act_embed")).reshape(e * c, d)
    return jnp.where(keep[:, None], yb[jnp.minimum(slot, e * c - 1)], 0), keep

  def _weights(self):
    """(w_gate_up [E, D, 2, I], w_down [E, I, D]) in the compute dtype, for the "ragged" paths (dense,
    blocked, grouped and the capacity buffer pass the parameters and cast inside: `cast_apply`)."""
    return self.w_gate_up[...].astype(self.dtype), self.w_down[...].astype(self.dtype)

  def _combine(self, ys, order, w):
    return combine(ys, order, w, self.dtype)

  def _blas_applies(self) -> bool:
    """`cfg.moe_grouped_blas`, XLA:CPU without a mesh, float32 weights and compute, and the kernels built."""
    f32 = jnp.float32
    return (self.grouped_blas and jax.default_backend() == "cpu" and sharding.active() is None
            and self.dtype == f32 and self.w_gate_up.dtype == f32 and self.w_down.dtype == f32
            and expert_kernel.available())

  def _kernel_experts(self, flat, w, idx):
    """Exact and dropless: each expert on its routed rows by `expert_kernel.swiglu_experts`."""
    order, _, sizes = sort_by_expert(idx, self.experts)
    ys = expert_kernel.swiglu_experts(flat[order // self.top_k].astype(jnp.float32), sizes, *self.decode_packed)
    return self._combine(ys, order, w)

  def _bounded(self, flat, w, idx):
    """Exact and dropless: the [E, C, D] capacity path with C = `capacity(N, k, E, DECODE_CAPACITY)`
    when no expert got more than C assignments, else (`lax.cond`, one branch runs) the dense path, or
    with `expert_slices` set the same path with C = N.
    E * C rows instead of the dense path's N * E; on XLA:CPU without a mesh one einsum per expert
    (`decode_expert_groups`), so both cores stream expert weights."""
    n, _ = flat.shape
    k, e = self.top_k, self.experts
    c = capacity(n, k, e, DECODE_CAPACITY)
    order, sorted_e, sizes = sort_by_expert(idx, e)

    def capped(slots: int):
      ys, _ = self._capacity_mlp(flat[order // k], sorted_e, sizes, slots, decode_expert_groups(e))
      return self._combine(ys, order, w)

    # With the weights split per expert (a CPU decode loop), an overflow takes the same per-expert path
    # with room for every token (an expert gets at most N assignments): the dense path's einsum would
    # first copy all E experts' stacked weights into its [D, E*2I] layout (~1.1 ms a layer at batch 16).
    overflow = (lambda _: capped(n)) if self.expert_slices is not None else (lambda _: self._dense(flat, w, idx))
    return jax.lax.cond(jnp.max(sizes) <= c, lambda _: capped(c), overflow, None)


class DenseMLP(nnx.Module):
  """SwiGLU MLP (transformers `Qwen3VLMoeTextMLP`): x [B, T, D] -> ([B, T, D], None)."""

  def __init__(self, d: int, i: int, rngs: nnx.Rngs, dtype=jnp.float32):
    self.gate_proj = nnx.Linear(d, i, use_bias=False, dtype=dtype, rngs=rngs, kernel_metadata=ax("embed", "mlp"))
    self.up_proj = nnx.Linear(d, i, use_bias=False, dtype=dtype, rngs=rngs, kernel_metadata=ax("embed", "mlp"))
    self.down_proj = nnx.Linear(i, d, use_bias=False, dtype=dtype, rngs=rngs, kernel_metadata=ax("mlp", "embed"))

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)), None
