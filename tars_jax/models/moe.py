"""Mixture-of-Experts MLP (Qwen3-MoE structure): softmax top-k router, SwiGLU experts,
switch-style load-balance loss (transformers `load_balancing_loss_func`)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax import sharding
from tars_jax.models.config import ModelConfig
from tars_jax.models.fast.cpu import expert_kernel
from tars_jax.models.fast.grouped_mlp import grouped_swiglu
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


# Smallest block worth gathering its expert's weights for: with fewer rows per expert on average the
# weight gathers cost more than the wasted FLOPs of the dense all-experts einsum, which is then faster
# on CPU (benchmarks/RESULTS.md).
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
  alive anyway), and fn is linear in each operand, so the backward recomputes only the cast: no bf16
  copy of the expert weights among the step's temporaries (`benchmarks/RESULTS.md`, "MoE paths
  without bf16 copies of the expert weights"). Same values and gradients as casting outside; with w
  already in `dtype` it is
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
  weights from memory, which one core does well below the machine's rate, so splitting the experts
  lets every core stream its share (`benchmarks/RESULTS.md`, "Batch-16 decode: one einsum per
  expert so both cores stream the weights").
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


def per_expert_swiglu(buf: jax.Array, gate_up: tuple, down: tuple) -> jax.Array:
  """`capacity_swiglu` with one einsum per expert over weights already split per expert: buf
  [E, C, D], gate_up E arrays [D, 2, I], down E arrays [I, D], all in buf's dtype -> [E, C, D]."""
  h = [swiglu(jnp.einsum("cd,dgi->cgi", buf[j], g), axis=1) for j, g in enumerate(gate_up)]
  return jnp.stack([jnp.einsum("ci,id->cd", hj, d) for hj, d in zip(h, down)])


# The expert computations `MoE` can run (`MoeStrategy.experts`), each exact against "dense" (the
# reference) except "capacity", which drops assignments over an expert's capacity by design.
EXPERT_STRATEGIES = ("dense", "ragged", "capacity", "all_to_all", "blocked", "grouped_xla", "grouped_blas")
# The experts' weight layout in the sampler's decode loop (`MoeStrategy.decode`, `decode_weights`).
DECODE_LAYOUTS = ("none", "split", "ffi")


@dataclasses.dataclass(frozen=True)
class MoeStrategy:
  """How the MoE layers of a model compute their experts, fixed when the model is built
  (`select_strategy`; static: part of the graphdef, never re-decided while tracing).

  experts: one of `EXPERT_STRATEGIES`:
    "dense" every token through every expert (the readable reference); "ragged" the sorted
    assignments through `jax.lax.ragged_dot`; "capacity" an [E, C, D] buffer that drops the
    assignments beyond C (`moe_capacity_factor`); "all_to_all" the assignments sent to their
    experts' shards (`expert_parallel.py`; "ragged" / "capacity" where the active mesh has nothing to
    exchange); "blocked" the sorted assignments in whole blocks of one expert; "grouped_xla" /
    "grouped_blas" an exact per-expert loop in XLA / as OpenBLAS custom calls (`expert_kernel.py`).
    "blocked" and "grouped_*" pick their regime from static shapes (`block_rows`): per-token gathers,
    the bounded [E, C, D] buffer (decode at a few rows per expert), or blocks / the loop.
  per_expert_dots: the bounded buffer's products as one einsum per expert (XLA:CPU without a mesh:
    independent ops run on separate cores) instead of one batched einsum (a mesh, an accelerator).
  decode: one of `DECODE_LAYOUTS`, the experts' weights in the sampler's decode loop
    (`decode_weights`): "ffi" tile-packed for the FFI kernel, "split" one array per expert for the
    per-expert einsums, "none" the parameters as they are.
  """
  experts: str
  per_expert_dots: bool
  decode: str

  def __post_init__(self):
    if self.experts not in EXPERT_STRATEGIES:
      raise ValueError(f"experts={self.experts!r}; known: {list(EXPERT_STRATEGIES)}")
    if self.decode not in DECODE_LAYOUTS:
      raise ValueError(f"decode={self.decode!r}; known: {list(DECODE_LAYOUTS)}")

  def summary(self) -> str:
    """One line for a run's banner, e.g. "experts=grouped_blas bounded=per_expert decode=ffi"."""
    bounded = ""
    if self.experts in ("blocked", "grouped_xla", "grouped_blas"):
      bounded = f" bounded={'per_expert' if self.per_expert_dots else 'batched'}"
    return f"experts={self.experts}{bounded} decode={self.decode}"


def decode_kernel_applies(cfg: ModelConfig) -> bool:
  """Whether `cfg`'s MoE layers take the FFI decode kernel in a CPU decode loop, as far as the config
  decides: `moe_decode_kernel`, a path with the bounded decode ("blocked" / "grouped"), and shapes and
  dtype the kernel supports (`expert_kernel.supports`). `select_strategy` also needs
  `expert_kernel.available()`, XLA:CPU without a mesh, and unscanned layers."""
  return (cfg.moe_decode_kernel and cfg.moe_impl in ("blocked", "grouped")
          and expert_kernel.supports(cfg.hidden, cfg.moe_intermediate, cfg.jdtype))


def select_strategy(backend: str, mesh, dtype, cfg: ModelConfig) -> MoeStrategy:
  """The `MoeStrategy` of `cfg`'s MoE layers on `backend` (`jax.default_backend()`), under `mesh`
  (a `jax.sharding.Mesh`, or None for one device) with compute `dtype`. Pure: called once when the
  model is built (`Decoder`), so tracing never consults the backend or the mesh to choose a path.

  The C++ kernels (`expert_kernel.py`) apply on XLA:CPU without a mesh, in float32, when built:
  "grouped" runs as "grouped_blas" with `cfg.moe_grouped_blas`, and the decode loop of "blocked" /
  "grouped" streams tile-packed weights ("ffi") with `cfg.moe_decode_kernel` and supported shapes,
  else per-expert copies ("split"). Scanned layers keep the stacked parameters ("none": the scan
  slices them per layer anyway).
  """
  cpu_alone = backend == "cpu" and mesh is None
  f32 = jnp.dtype(dtype) == jnp.float32
  impl = cfg.moe_impl
  if impl == "ragged":
    experts = ("all_to_all" if cfg.moe_dispatch == "all_to_all"
               else "ragged" if cfg.moe_capacity_factor is None else "capacity")
  elif impl == "grouped":
    blas = cfg.moe_grouped_blas and cpu_alone and f32 and expert_kernel.available()
    experts = "grouped_blas" if blas else "grouped_xla"
  else:
    experts = impl
  decode = "none"
  if impl in ("blocked", "grouped") and cpu_alone and not cfg.scan_layers:
    decode = "ffi" if decode_kernel_applies(cfg) and expert_kernel.available() else "split"
  return MoeStrategy(experts, cpu_alone, decode)


def build_strategy(cfg: ModelConfig) -> MoeStrategy:
  """`select_strategy` for this process now: the default backend and the mesh of the enclosing
  `sharding.activate` (build a model that runs under a mesh inside that context)."""
  active = sharding.active()
  return select_strategy(jax.default_backend(), None if active is None else active[0], cfg.jdtype, cfg)


def decode_layout(mod: "MoE"):
  """The decode-loop weights of one `MoE` layer, a pure function of its parameters: by
  `mod.strategy.decode`, "ffi" (packed gate|up, packed down) for `expert_kernel.swiglu_experts`,
  "split" (E arrays [D, 2, I], E arrays [I, D]) in the compute dtype for `per_expert_swiglu`, "none"
  None. Kept apart from the loop by an `optimization_barrier`, so XLA makes the copy once, not per
  step (without it XLA:CPU copies each expert's slice out of the stacked parameter at every step).
  Either layout costs one more copy of the expert weights while the loop runs."""
  kind = mod.strategy.decode
  if kind == "none":
    return None
  gu, dn = mod.w_gate_up[...].astype(mod.dtype), mod.w_down[...].astype(mod.dtype)
  if kind == "ffi":
    return jax.lax.optimization_barrier((expert_kernel.pack_gate_up(gu), expert_kernel.pack_down(dn)))
  return jax.lax.optimization_barrier((tuple(gu[j] for j in range(mod.experts)),
                                       tuple(dn[j] for j in range(mod.experts))))


def prepare_decode_weights(model: nnx.Module) -> tuple | None:
  """The decode-loop weights of every decoder layer of `model` (a `Policy` or `Trunk`): a tuple with
  one `decode_layout` per layer (None for dense layers and where the strategy has no decode layout),
  or None when no layer has one (scanned layers, a mesh, an accelerator, "dense" / "ragged"). The
  sampler makes it once after the prefill and passes it to every decode step
  (`Policy.__call__(decode_weights=...)`). Source of the per-step saving: `benchmarks/RESULTS.md`
  (decode with split experts, decode experts as an FFI kernel)."""
  trunk = getattr(model, "trunk", model)
  layers = trunk.decoder.layers
  if trunk.cfg.scan_layers:
    return None
  out = tuple(decode_layout(layer.mlp) if isinstance(layer.mlp, MoE) else None for layer in layers)
  return out if any(w is not None for w in out) else None


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
  one [D, 2I] matmul (a free reshape, no per-step concatenation or gradient split; benchmarks/RESULTS.md,
  "Train step vs torch with gate|up stored as one parameter"), and the size-2 axis apart from I keeps
  I shardable over `tensor` (gate and up
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
  Which of these runs, and on which kernels, is the layer's `MoeStrategy` (`select_strategy`, chosen
  once when the model is built, e.g. "grouped_blas": the "grouped" loop as OpenBLAS custom calls on
  XLA:CPU without a mesh). The computation is always route -> sort by expert -> experts -> combine,
  "dense" being the readable reference the others are tested against.
  `decode_weights` (from `decode_layout`, in the sampler's decode loop): the experts' weights in the
  strategy's decode layout, tile-packed for the FFI kernel or split per expert.
  Source: maxtext `MaxText/layers/moe.py` (`sparse_matmul` with `ragged_dot`, `dense_matmul` with
  capacity); Fedus et al. 2021 (capacity factor).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, strategy: MoeStrategy | None = None):
    """strategy: None = `build_strategy(cfg)` (this process's backend and active mesh, now)."""
    d, i, e = cfg.hidden, cfg.moe_intermediate, cfg.experts
    self.top_k, self.norm_topk_prob, self.experts = cfg.top_k, cfg.norm_topk_prob, e
    self.dtype = cfg.jdtype
    self.capacity_factor = cfg.moe_capacity_factor
    self.strategy = build_strategy(cfg) if strategy is None else strategy
    # fan-in = D for gate/up, I for down (the default lecun_normal would take the expert axis).
    init_in = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                   batch_axis=(0,))
    self.router = nnx.Linear(d, e, use_bias=False, dtype=jnp.float32, rngs=rngs, kernel_metadata=ax("embed", None))
    self.w_gate_up = nnx.Param(init_in(rngs.params(), (e, d, 2 * i)).reshape(e, d, 2, i),
                               **ax("expert", "embed", None, "mlp"))
    self.w_down = nnx.Param(init_in(rngs.params(), (e, i, d)), **ax("expert", "mlp", "embed"))

  def __call__(self, x: jax.Array, decode_weights=None):
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    probs, w, idx = route(self.router(flat), self.top_k, self.norm_topk_prob)
    y, dropped = self.experts_fn()(flat, w, idx, decode_weights)
    return y.reshape(b, t, d), ((probs, idx) if dropped is None else (probs, idx, dropped))

  def experts_fn(self):
    """The strategy's expert computation: (flat [N, D], w [N, k], idx [N, k], decode_weights) ->
    (y [N, D], dropped float32 count or None (dropless))."""
    return {"dense": self._dense_strategy, "ragged": self._ragged_strategy, "capacity": self._ragged_strategy,
            "all_to_all": self._all_to_all_strategy, "blocked": self._blocked_strategy,
            "grouped_xla": self._blocked_strategy, "grouped_blas": self._blocked_strategy}[self.strategy.experts]

  def _dense_strategy(self, flat, w, idx, decode_weights):
    return self._dense(flat, w, idx), None

  def _ragged_strategy(self, flat, w, idx, decode_weights):
    return self._grouped(flat, w, idx)

  def _all_to_all_strategy(self, flat, w, idx, decode_weights):
    """The explicit exchange under the mesh it shards over (`sharding.active()`: the mesh is the
    shard_map's data here, not a choice of path); "ragged" / "capacity" where that mesh has nothing to
    exchange (`expert_parallel.applies`, e.g. one decoded sequence)."""
    from tars_jax.models.fast import expert_parallel  # here, not at the top: it imports this module's helpers
    mesh_rules = sharding.active()
    if mesh_rules and expert_parallel.applies(*mesh_rules, self.experts, flat.shape[0]):
      y, dropped = expert_parallel.moe_all_to_all(flat, w, idx, *self._weights(), *mesh_rules,
                                                  capacity_factor=self.capacity_factor)
      return y, (None if self.capacity_factor is None else dropped)
    return self._grouped(flat, w, idx)

  def _blocked_strategy(self, flat, w, idx, decode_weights):
    """"blocked" / "grouped_*": the regime from static shapes (`block_rows`)."""
    n = flat.shape[0]
    rows = block_rows(n * self.top_k, self.experts)
    if self.strategy.decode == "ffi" and decode_weights is not None:  # any N, dropless
      y = self._kernel_experts(flat, w, idx, decode_weights)
    elif rows > 1 and self.strategy.experts != "blocked":
      y = self._grouped_loop(flat, w, idx, min(rows, GROUPED_ROWS))
    elif rows:
      y = self._blocked(flat, w, idx, rows)
    elif capacity(n, self.top_k, self.experts, DECODE_CAPACITY) < n:  # too few rows per expert for blocks
      y = self._bounded(flat, w, idx, decode_weights)
    else:  # a buffer of C >= N rows per expert is no smaller than the dense path
      y = self._dense(flat, w, idx)
    return y, None

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
    """The "grouped_*" loop: exact per-expert groups, as OpenBLAS custom calls ("grouped_blas" with
    float32 weights: one call forward, one backward, `expert_kernel.grouped_swiglu`), else in chunks of
    `rows` in an XLA loop (`grouped_mlp.grouped_swiglu`)."""
    k, e, dt = self.top_k, self.experts, self.dtype
    order, _, sizes = sort_by_expert(idx, e)
    xs = flat[order // k].astype(dt)
    # weights of another dtype than the float32 the strategy was chosen for (a merged state): XLA's loop
    f32_weights = self.w_gate_up.dtype == jnp.float32 and self.w_down.dtype == jnp.float32
    if self.strategy.experts == "grouped_blas" and f32_weights:
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

  def _capacity_mlp(self, xs, sorted_e, sizes, c: int, groups: int = 1, split=None):
    """Experts over an [E, C, D] buffer: xs [N*k, D] sorted by expert -> (ys [N*k, D] in the same
    order, 0 for dropped assignments; keep [N*k] bool: within its expert's first C). `groups`: see
    `capacity_swiglu`; `split`: the "split" decode layout (per-expert weights), used with groups = E."""
    g, d = xs.shape
    e, dt = self.experts, self.dtype
    rank = rank_in_group(sorted_e, sizes)
    keep = rank < c
    slot = jnp.where(keep, sorted_e * c + rank, e * c)  # dropped -> a spare row, cut off below
    buf = jnp.zeros((e * c + 1, d), dt).at[slot].set(xs.astype(dt))[:-1].reshape(e, c, d)
    buf = constrain(buf, ("act_expert", None, "act_embed"))  # the dispatch: [E, C, D] over experts
    if split is not None and groups == e:
      yb = per_expert_swiglu(buf, *split)
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

  def _kernel_experts(self, flat, w, idx, packed):
    """Exact and dropless: each expert on its routed rows by `expert_kernel.swiglu_experts` over the
    "ffi" decode layout `packed` (`decode_layout`)."""
    order, _, sizes = sort_by_expert(idx, self.experts)
    ys = expert_kernel.swiglu_experts(flat[order // self.top_k].astype(jnp.float32), sizes, *packed)
    return self._combine(ys, order, w)

  def _bounded(self, flat, w, idx, decode_weights=None):
    """Exact and dropless: the [E, C, D] capacity path with C = `capacity(N, k, E, DECODE_CAPACITY)`
    when no expert got more than C assignments, else (`lax.cond`, one branch runs) the dense path, or
    with the "split" decode layout the same path with C = N.
    E * C rows instead of the dense path's N * E; with `strategy.per_expert_dots` one einsum per
    expert, so both cores of XLA:CPU stream expert weights."""
    n, _ = flat.shape
    k, e = self.top_k, self.experts
    c = capacity(n, k, e, DECODE_CAPACITY)
    order, sorted_e, sizes = sort_by_expert(idx, e)
    groups = e if self.strategy.per_expert_dots else 1
    split = decode_weights if self.strategy.decode == "split" else None

    def capped(slots: int):
      ys, _ = self._capacity_mlp(flat[order // k], sorted_e, sizes, slots, groups, split)
      return self._combine(ys, order, w)

    # With the weights split per expert (a CPU decode loop), an overflow takes the same per-expert path
    # with room for every token (an expert gets at most N assignments): the dense path's einsum would
    # first copy all E experts' stacked weights into its [D, E*2I] layout, every layer and step.
    overflow = (lambda _: capped(n)) if split is not None else (lambda _: self._dense(flat, w, idx))
    return jax.lax.cond(jnp.max(sizes) <= c, lambda _: capped(c), overflow, None)


class DenseMLP(nnx.Module):
  """SwiGLU MLP (transformers `Qwen3VLMoeTextMLP`): x [B, T, D] -> ([B, T, D], None)."""

  def __init__(self, d: int, i: int, rngs: nnx.Rngs, dtype=jnp.float32):
    self.gate_proj = nnx.Linear(d, i, use_bias=False, dtype=dtype, rngs=rngs, kernel_metadata=ax("embed", "mlp"))
    self.up_proj = nnx.Linear(d, i, use_bias=False, dtype=dtype, rngs=rngs, kernel_metadata=ax("embed", "mlp"))
    self.down_proj = nnx.Linear(i, d, use_bias=False, dtype=dtype, rngs=rngs, kernel_metadata=ax("mlp", "embed"))

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)), None
