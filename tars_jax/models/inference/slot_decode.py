"""Continuous-batching decode over a fixed set of KV-cache slots (the device half of
`rollout/inference_server.py`'s `InferenceService`).

Where `sampler.generate` runs one batch of prompts from prefill to the last EOS in one
`lax.while_loop`, here each of S slots holds one request at its own cache cursor, and the host
calls three jitted programs between which requests join and leave:

  prefill(n prompts [n, P])  -> their own small caches, next-token logits, decode positions
  insert(slots, prefilled, slot ids)  -> the n requests occupy those slots (cache rows 0..P-1)
  extend(slots, n new token blocks, slot ids) -> the next turn of the episodes those slots hold:
                  only its new tokens are run (multi-turn KV reuse)
  step(slots)  -> one decode chunk (1 sampled token + up to K-1 grammar-forced tokens) in every
                  active slot; a slot goes inactive after EOS or when its token budget is spent

Each slot samples with its own PRNG key, split once per step exactly as `sampler.generate` splits
its key (`key, sub = split(key)`; `categorical(sub, logp)`), so one request decoded alone in a slot
draws the tokens `sampler.generate` draws for it as a batch of one with the same key: random bits
depend on the key and the number of values drawn, not on the batch around them (tested). The chunk
logic (sampled token, then the tokens the grammar forces, log-prob 0) is `sampler.generate`'s.

`step` and `extend` attend over the first `span` cache positions of each slot only (a static size the
caller buckets: `InferenceService` uses 256 * 2**k), not all L: a decode step streams every slot's keys and values, and a
cache sized for the longest episode (L) is mostly empty. The caller picks a span that holds every
position a slot may still read or write (the cursors of slots that hold a request or an idle session,
plus the tokens written): positions past it are untouched.

Shapes are fixed by (S slots, L cache length, K chunk): `step` compiles once per span, `insert` once per
(n, P), `extend` once per (n, P, M images, span) and `prefill` once per (n, P, M) bucket. Single device
(no mesh) for now.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.models import moe
from tars_jax.models.decoder import KVCache
from tars_jax.models.fast.cpu import compile_options
from tars_jax.models.inference.sampler import constrained_log_softmax, forced_tokens, jump_forward_chunk, top_p_filter
from tars_jax.models.rope import next_position, rope_positions


class Slots(NamedTuple):
  """Device state of S decode slots (a pytree).

  cache: `KVCache` with S rows of L slots; last: [S, V] float32 logits of each slot's next token;
  state: [S] int32 grammar state (-1 without grammar); cur: [S] int32 next cache slot to write;
  npos: [S] int32 rope position of the next token; left: [S] int32 tokens the request may still
  emit; key: [S, 2] uint32 per-slot PRNG key; active: [S] bool (holds an unfinished request).
  """
  cache: KVCache
  last: jax.Array
  state: jax.Array
  cur: jax.Array
  npos: jax.Array
  left: jax.Array
  key: jax.Array
  active: jax.Array


class Prefilled(NamedTuple):
  """n prefilled prompts: cache [n rows, P slots]; last [n, V] float32; npos [n] int32."""
  cache: KVCache
  last: jax.Array
  npos: jax.Array


class Chunk(NamedTuple):
  """What one `step` emitted: tokens [S, K] int32 (PAD where invalid), logprobs [S, K] float32,
  states [S, K] int32 (grammar state before each token), lengths [S] int32 valid tokens per slot,
  active [S] bool after the step (False: the request ended with this chunk or earlier)."""
  tokens: jax.Array
  logprobs: jax.Array
  states: jax.Array
  lengths: jax.Array
  active: jax.Array


def _head(cache: KVCache, span: int) -> KVCache:
  """The first `span` positions of every slot: k / v head-major [..., S, hd] (stacked or per layer),
  mask [B, S]."""
  cut = lambda x: x[..., :span, :]
  return KVCache(jax.tree.map(cut, cache.k), jax.tree.map(cut, cache.v), cache.mask[:, :span])


def _put_head(full: KVCache, head: KVCache) -> KVCache:
  """`full` with its first positions replaced by `head`'s (in place when `full` is donated)."""
  put = lambda b, x: jax.lax.dynamic_update_slice(b, x.astype(b.dtype), (0,) * b.ndim)
  return KVCache(jax.tree.map(put, full.k, head.k), jax.tree.map(put, full.v, head.v), put(full.mask, head.mask))


def init_slots(model, slots: int, length: int) -> Slots:
  """S empty, inactive slots of `length` cache positions for `model` (a `Policy`)."""
  v = model.cfg.vocab_size
  c = model.init_cache(slots, length)
  # own buffers for k and v (init_cache may share one zeros array): `step` and `insert` donate them
  cache = KVCache(jax.tree.map(jnp.zeros_like, c.k), jax.tree.map(jnp.zeros_like, c.v), jnp.zeros_like(c.mask))
  return Slots(cache, jnp.zeros((slots, v), jnp.float32),
               jnp.full((slots,), -1, jnp.int32), jnp.zeros((slots,), jnp.int32),
               jnp.zeros((slots,), jnp.int32), jnp.zeros((slots,), jnp.int32),
               jnp.zeros((slots, 2), jnp.uint32), jnp.zeros((slots,), bool))


def _prefill_fn(params, tokens, attn_mask, pixel_values, image_mask, *, graphdef, image_token_id):
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  itok = cfg.image_token_id if image_token_id is None else image_token_id
  attn_mask = attn_mask.astype(bool)
  pos = rope_positions(tokens, attn_mask, itok, cfg.merged_grid)
  out = model(tokens, pos, attn_mask, pixel_values, image_mask, cache=model.init_cache(*tokens.shape),
              cache_index=0)
  # left padding: the last position is every row's last real token
  return Prefilled(out.cache, out.logits[:, -1], next_position(tokens, attn_mask, itok, cfg.merged_grid))


_prefill = jax.jit(_prefill_fn, static_argnames=("graphdef", "image_token_id"))


def prefill(graphdef, params, tokens, attn_mask, pixel_values, image_mask, image_token_id=None) -> Prefilled:
  """Runs n LEFT-padded prompts through the model into a cache of exactly their P slots.

  tokens [n, P] int32; attn_mask [n, P] bool; pixel_values [n, M, H, W, 3] float32 in [0, 1] or None;
  image_mask [n, M] bool or None. Compiles once per (n, P, M) shape.
  """
  return _prefill(params, tokens, attn_mask, pixel_values, image_mask, graphdef=graphdef,
                  image_token_id=image_token_id)


def _put_rows(big: jax.Array, small: jax.Array, idx: jax.Array, batch_axis: int) -> jax.Array:
  """big[..., idx[j], ..., :P, ...] = small[..., j, ..., :P, ...] along the slot axis (the batch
  axis + 1 for the mask, + 2 for head-major k / v); rows with idx >= S are dropped."""
  p = small.shape[-1] if small.ndim == 2 else small.shape[-2]
  if small.ndim == 2:  # mask [n, P] -> row becomes [small, False...]
    rows = jnp.zeros((small.shape[0], big.shape[1]), big.dtype).at[:, :p].set(small)
    return big.at[idx].set(rows, mode="drop")
  moved_big = jnp.moveaxis(big, batch_axis, 0)
  moved_small = jnp.moveaxis(small, batch_axis, 0)
  out = moved_big.at[idx, ..., :p, :].set(moved_small.astype(big.dtype), mode="drop")
  return jnp.moveaxis(out, 0, batch_axis)


def _insert_fn(slots: Slots, pre: Prefilled, idx, keys, start_state, budget) -> Slots:
  stacked = not isinstance(slots.cache.k, tuple)  # scanned layers: [layers, B, KV, S, hd]
  ax = 1 if stacked else 0
  put = lambda b, s: _put_rows(b, s, idx, ax)
  if stacked:
    k, v = put(slots.cache.k, pre.cache.k), put(slots.cache.v, pre.cache.v)
  else:
    k = tuple(put(b, s) for b, s in zip(slots.cache.k, pre.cache.k))
    v = tuple(put(b, s) for b, s in zip(slots.cache.v, pre.cache.v))
  mask = _put_rows(slots.cache.mask, pre.cache.mask, idx, 0)
  p = pre.cache.mask.shape[1]
  setr = lambda buf, x: buf.at[idx].set(x.astype(buf.dtype), mode="drop")
  return Slots(KVCache(k, v, mask), setr(slots.last, pre.last), setr(slots.state, start_state),
               setr(slots.cur, jnp.full(idx.shape, p, jnp.int32)), setr(slots.npos, pre.npos),
               setr(slots.left, budget), setr(slots.key, keys), setr(slots.active, jnp.ones(idx.shape, bool)))


_insert = jax.jit(_insert_fn, donate_argnums=(0,))


def insert(slots: Slots, pre: Prefilled, idx, keys, start_state, budget) -> Slots:
  """The n prefilled requests take slots `idx` [n] int32 (an index >= S drops that row: filler rows
  of a padded prefill group). keys [n, 2] uint32 their PRNG keys; start_state [n] int32 grammar
  start states (-1 without grammar); budget [n] int32 max new tokens. The slot's cache row becomes
  the prefilled P slots followed by empty (masked) ones. `slots` is donated."""
  return _insert(slots, pre, jnp.asarray(idx, jnp.int32), jnp.asarray(keys, jnp.uint32),
                 jnp.asarray(start_state, jnp.int32), jnp.asarray(budget, jnp.int32))


def _extend_fn(params, slots: Slots, tokens, attn_mask, pixel_values, image_mask, idx, keys, start_state, budget,
               *, graphdef, image_token_id, span):
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  itok = cfg.image_token_id if image_token_id is None else image_token_id
  attn_mask = attn_mask.astype(bool)
  stacked = not isinstance(slots.cache.k, tuple)
  ax = 1 if stacked else 0
  gather = lambda x, a: jnp.take(x, idx, axis=a, mode="clip")  # filler rows (idx = S) read a slot, dropped below
  scatter = lambda big, rows, a: _put_rows(big, rows, idx, a)  # the rows' first `span` positions
  head = _head(slots.cache, span)
  if stacked:
    rows = KVCache(gather(head.k, 1), gather(head.v, 1), gather(head.mask, 0))
  else:
    rows = KVCache(tuple(gather(x, 0) for x in head.k), tuple(gather(x, 0) for x in head.v), gather(head.mask, 0))
  cur, npos = gather(slots.cur, 0), gather(slots.npos, 0)
  # positions continue the slot's context: the new tokens' own M-RoPE positions shifted by its next one
  pos = rope_positions(tokens, attn_mask, itok, cfg.merged_grid) + npos[None, :, None]
  out = model(tokens, pos, attn_mask, pixel_values, image_mask, cache=rows, cache_index=cur)
  c = out.cache
  if stacked:
    k, v = scatter(slots.cache.k, c.k, 1), scatter(slots.cache.v, c.v, 1)
  else:
    k = tuple(scatter(b, r, 0) for b, r in zip(slots.cache.k, c.k))
    v = tuple(scatter(b, r, 0) for b, r in zip(slots.cache.v, c.v))
  mask = scatter(slots.cache.mask, c.mask, 0)
  setr = lambda buf, x: buf.at[idx].set(x.astype(buf.dtype), mode="drop")
  p = tokens.shape[1]
  return Slots(KVCache(k, v, mask), setr(slots.last, out.logits[:, -1]), setr(slots.state, start_state),
               setr(slots.cur, cur + p), setr(slots.npos, npos + next_position(tokens, attn_mask, itok, cfg.merged_grid)),
               setr(slots.left, budget), setr(slots.key, keys), setr(slots.active, jnp.ones(idx.shape, bool)))


_extend = jax.jit(_extend_fn, static_argnames=("graphdef", "image_token_id", "span"), donate_argnums=(1,))


def extend(graphdef, params, slots: Slots, tokens, attn_mask, pixel_values, image_mask, idx, keys, start_state,
           budget, image_token_id=None, span: int | None = None) -> Slots:
  """Continues the contexts held by slots `idx` [n] int32 with n LEFT-padded token blocks [n, P] (a
  multi-turn episode's next observation: only its new tokens are run; the earlier turns' keys and
  values stay in the slot). attn_mask [n, P] bool; pixel_values [n, M, H, W, 3] float32 / image_mask
  [n, M] bool: the images of the new blocks only. The new tokens go to cache slots cur .. cur + P - 1
  (padding included, masked), their M-RoPE positions continue the slot's (`rope_positions` shifted by
  its next position, as one prefill of the whole context numbers them). Then the slot decodes as after
  `insert`: keys [n, 2], start_state [n], budget [n]. An index >= S drops that row. The caller checks
  cur + P + budget + chunk <= L. span: the new tokens attend over the slots' first `span` positions
  (None: all L); the caller's span holds cur + P of every row. `slots` is donated. Compiles once per
  (n, P, M, span).
  """
  span = slots.cache.mask.shape[1] if span is None else int(span)
  return _extend(params, slots, jnp.asarray(tokens, jnp.int32), jnp.asarray(attn_mask, bool), pixel_values,
                 image_mask, jnp.asarray(idx, jnp.int32), jnp.asarray(keys, jnp.uint32),
                 jnp.asarray(start_state, jnp.int32), jnp.asarray(budget, jnp.int32), graphdef=graphdef,
                 image_token_id=image_token_id, span=span)


def release(slots: Slots, idx) -> Slots:
  """Marks slots `idx` [n] inactive (a request cancelled by the host)."""
  return slots._replace(active=slots.active.at[jnp.asarray(idx, jnp.int32)].set(False, mode="drop"))


def _step_fn(params, decode_weights, slots: Slots, table, *, graphdef, temperature, top_p, eos_id, pad_id,
             chunk, span):
  model = nnx.merge(graphdef, params)
  s, k = slots.state.shape[0], chunk
  use_grammar = table is not None
  forced = forced_tokens(table) if use_grammar and k > 1 else None
  split = jax.vmap(jax.random.split)(slots.key)  # [S, 2, 2]: as sampler.generate, per slot
  key, sub = split[:, 0], split[:, 1]
  allowed = table[jnp.maximum(slots.state, 0)] >= 0 if use_grammar else None
  logp = constrained_log_softmax(slots.last, allowed, temperature)
  if temperature == 0:
    tok = jnp.argmax(logp, axis=-1)
  else:
    dist = top_p_filter(logp, top_p) if top_p < 1.0 else logp
    tok = jax.vmap(lambda kk, lp: jax.random.categorical(kk, lp))(sub, dist)
  tok = tok.astype(jnp.int32)
  lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
  live = slots.active & (slots.left > 0)
  ctoks, clps, csts, cvalid = jump_forward_chunk(table, forced, slots.state, tok, lp, live, slots.left, k, eos_id,
                                                 pad_id)  # [S, K]
  length = cvalid.sum(1).astype(jnp.int32)
  last_i = jnp.maximum(length - 1, 0)[:, None]
  last_tok = jnp.take_along_axis(ctoks, last_i, axis=1)[:, 0]
  new_state = slots.state
  if use_grammar:
    last_st = jnp.take_along_axis(csts, last_i, axis=1)[:, 0]
    new_state = jnp.where(length > 0, table[jnp.maximum(last_st, 0), last_tok], slots.state)
  positions = jnp.broadcast_to((slots.npos[:, None] + jnp.arange(k))[None], (3, s, k))
  # the first `span` positions only: every slot the caller reads later (a request, an idle session) has
  # its cursor + chunk inside, so its write lands where it would in the whole cache; a free slot's write
  # may be clamped into its own row, which holds nothing (`insert` rewrites a row it fills)
  out = model(ctoks, positions, cvalid, cache=_head(slots.cache, span), cache_index=slots.cur,
              decode_weights=decode_weights)
  new_last = jnp.take_along_axis(out.logits, last_i[:, :, None], axis=1)[:, 0]
  left = slots.left - length
  active = slots.active & (left > 0) & ~((length > 0) & (last_tok == eos_id))
  new = Slots(_put_head(slots.cache, out.cache), jnp.where((length > 0)[:, None], new_last, slots.last), new_state,
              slots.cur + length, slots.npos + length, left, jnp.where(live[:, None], key, slots.key), active)
  return new, Chunk(ctoks, clps, csts, length, active)


_STEP_STATIC = ("graphdef", "temperature", "top_p", "eos_id", "pad_id", "chunk", "span")
# On CPU without YNNPACK fusions, as the sampler's decode loop (`compile_options`).
_step = compile_options.jit_per_backend(_step_fn, cpu_options=compile_options.DECODE_CPU_OPTIONS,
                                        static_argnames=_STEP_STATIC, donate_argnums=(2,))


def step(graphdef, params, decode_weights, slots: Slots, table, *, temperature: float, top_p: float,
         eos_id: int, pad_id: int, chunk: int, span: int | None = None) -> tuple[Slots, Chunk]:
  """One decode chunk in every active slot (inactive slots emit nothing: length 0, key unchanged).

  decode_weights: `prepare_decode_weights(graphdef, params)` of the same params (or None).
  table: [G, V] int32 grammar automaton or None. chunk: K >= 1 tokens per step (1 sampled, the
  rest grammar-forced; 1 without grammar). span: attend over (and write into) the first `span` cache
  positions (None: all L); it must hold cur + chunk of every slot whose cache is read later (a request
  or an idle session), since a write past it is clamped into it. `slots` is donated.
  Returns (new slots, `Chunk`).
  """
  return _step(params, decode_weights, slots, table, graphdef=graphdef, temperature=float(temperature),
               top_p=float(top_p), eos_id=int(eos_id), pad_id=int(pad_id),
               chunk=int(chunk) if table is not None else 1,
               span=slots.cache.mask.shape[1] if span is None else int(span))


def _prepare_fn(params, *, graphdef):
  return moe.prepare_decode_weights(nnx.merge(graphdef, params))


_prepare = jax.jit(_prepare_fn, static_argnames=("graphdef",))


def prepare_decode_weights(graphdef, params):
  """The MoE experts' weights in the decode layout of the model's strategy (None for dense models):
  made once per weight version, passed to every `step` (`moe.prepare_decode_weights`)."""
  return _prepare(params, graphdef=graphdef)
