"""KV-cache sampling (jitted prefill + `lax.while_loop` decode that stops when every row is done)
with temperature, top-p and grammar-constrained decoding.

Constrained decoding: `grammar_table [S, V] int32` gives the next automaton state for (state, token),
-1 = not allowed (`tars_jax/agent/grammar.py`). Each step masks the logits to the row's allowed
tokens, samples, and advances the row's state. The returned log-probs are those of the constrained,
temperature-scaled distribution, log_softmax((logits / temperature) masked to the allowed set) —
exactly what PPO recomputes in training (`token_logprobs`, `rl.losses.masked_log_softmax`).
With top_p < 1 the token is drawn from the nucleus of that distribution but the returned log-prob
is still the un-truncated one (PPO off-policy caveat; training configs keep top_p = 1, which is
exactly plain sampling). temperature = 0 is greedy decoding (argmax of the masked logits) and
returns temperature-1 log-probs.
On CPU the loop compiles without XLA:CPU's YNNPACK fusions (`compile_options`: faster few-row dots)
and passes the MoE weights to each step in the decode layout of the model's `MoeStrategy`, made once
after the prefill (`moe.prepare_decode_weights`): tile-packed for the FFI expert kernel
(`expert_kernel.py`), or per-expert copies for XLA's dots.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.agent.tokenizer import EOS, PAD
from tars_jax.models import moe
from tars_jax.models.fast.cpu import compile_options
from tars_jax.models.rope import next_position, rope_positions
from tars_jax.rl.losses import masked_log_softmax


class Generation(NamedTuple):
  tokens: jax.Array  # [B, N] int32; PAD after EOS
  logprobs: jax.Array  # [B, N] float32; 0 after EOS
  states: jax.Array  # [B, N] int32 grammar state before each token (-1 without grammar)
  lengths: jax.Array  # [B] int32 tokens up to and including EOS (N if no EOS)


def constrained_log_softmax(logits: jax.Array, allowed: jax.Array | None, temperature: float) -> jax.Array:
  """[..., V] float32 log-probs of softmax((logits / T) restricted to `allowed` [..., V] bool).

  T = 0 (greedy) uses T = 1. Disallowed tokens get about -1e9 (probability exactly 0).
  """
  return masked_log_softmax(logits, allowed, 1.0 if temperature == 0 else temperature)


def token_logprobs(logits: jax.Array, targets: jax.Array, allowed_mask: jax.Array | None = None,
                   temperature: float = 1.0) -> jax.Array:
  """Log-probs [B, T] float32 of `targets` [B, T] int32 under the sampler's distribution.

  Args:
    logits: [B, T, V] (logits[:, j] predicts targets[:, j]); allowed_mask: None or [B, T, V] bool
      (`grammar_table[states] >= 0`); temperature: as given to `generate`.
  """
  logp = constrained_log_softmax(logits, allowed_mask, temperature)
  return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def top_p_filter(logp: jax.Array, top_p: float) -> jax.Array:
  """Keeps the smallest set of most likely tokens whose probability sums to >= top_p; the others
  get -1e9. logp [..., V] normalised log-probs -> [..., V] (Holtzman et al. 2020, nucleus sampling)."""
  sorted_lp = jnp.sort(logp, axis=-1)[..., ::-1]
  cum = jnp.cumsum(jnp.exp(sorted_lp), axis=-1)
  cutoff_idx = jnp.minimum(jnp.sum(cum < top_p, axis=-1, keepdims=True), logp.shape[-1] - 1)
  cutoff = jnp.take_along_axis(sorted_lp, cutoff_idx, axis=-1)
  return jnp.where(logp >= cutoff, logp, -1e9)


def forced_tokens(table: jax.Array) -> jax.Array:
  """[S] int32: the only allowed token of each grammar state, or -1 where 0 or >= 2 are allowed."""
  ok = table >= 0
  return jnp.where(ok.sum(-1) == 1, jnp.argmax(ok, axis=-1), -1).astype(jnp.int32)


def jump_forward_chunk(table, forced, state, tok, lp, valid, room, k: int, eos_id: int, pad_id: int):
  """A decode chunk: the sampled token, then (jump-forward) up to k - 1 tokens the grammar forces
  after it, which have probability 1 and log-prob 0 under the constrained distribution.

  table [S, V] int32 grammar (None only with k = 1); forced [S] int32 (`forced_tokens`); state [B]
  int32 grammar state before `tok`; tok [B] int32 sampled; lp [B] float32 its log-prob; valid [B]
  bool (the row emits); room [B] int32 tokens the row may still emit. Returns (tokens, logprobs,
  states before each token, valid) [B, k]: PAD / 0 where not valid; length = valid.sum(1).
  """
  toks, lps, sts, oks = [tok], [lp], [state], [valid]
  st, t = state, tok
  for j in range(1, k):
    st = table[jnp.maximum(st, 0), t]
    t = forced[jnp.maximum(st, 0)]
    ok = oks[-1] & (toks[-1] != eos_id) & (t >= 0) & (j < room)
    toks.append(jnp.where(ok, t, pad_id))
    lps.append(jnp.zeros_like(lp))
    sts.append(st)
    oks.append(ok)
  ctoks, clps, csts, cvalid = (jnp.stack(x, axis=1) for x in (toks, lps, sts, oks))  # [B, K]
  return jnp.where(cvalid, ctoks, pad_id), jnp.where(cvalid, clps, 0.0), csts, cvalid


def _generate_fn(params, tokens, attn_mask, pixel_values, image_mask, key, table, start_state, *, graphdef,
                 max_new_tokens, temperature, top_p, eos_id, pad_id, image_token_id, chunk):
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  if image_token_id is None:
    image_token_id = cfg.image_token_id
  b, p = tokens.shape
  n, k = max_new_tokens, chunk
  grid = cfg.merged_grid
  attn_mask = attn_mask.astype(bool)
  use_grammar = table is not None
  forced = forced_tokens(table) if use_grammar and k > 1 else None
  rows = jnp.arange(b)

  # Prefill: the whole prompt (with images) into slots 0..P-1 of a P+N+K slot cache (a row's
  # cursor never passes P+N, and a chunk of K slots must fit after it).
  pos = rope_positions(tokens, attn_mask, image_token_id, grid)
  cache = model.init_cache(b, p + n + k)
  prefill = model(tokens, pos, attn_mask, pixel_values, image_mask, cache=cache, cache_index=0)
  last, cache = prefill.logits[:, -1], prefill.cache  # left padding: the last slot is every row's last real token
  # The experts' weights in the layout of the model's MoE strategy (None: the parameters as they are),
  # made once here and passed to every step of the loop.
  decode_weights = moe.prepare_decode_weights(model)

  def cond(c):
    return (c["i"] < n) & ~jnp.all(c["done"] | (c["out"] >= n))

  def body(c):
    state, done, out = c["state"], c["done"] | (c["out"] >= n), c["out"]
    key, sub = jax.random.split(c["key"])
    allowed = table[jnp.maximum(state, 0)] >= 0 if use_grammar else None
    logp = constrained_log_softmax(c["last"], allowed, temperature)
    if temperature == 0:
      tok = jnp.argmax(logp, axis=-1)
    else:
      tok = jax.random.categorical(sub, top_p_filter(logp, top_p) if top_p < 1.0 else logp, axis=-1)
    tok = tok.astype(jnp.int32)
    lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
    ctoks, clps, csts, cvalid = jump_forward_chunk(table, forced, state, tok, lp, ~done, n - out, k, eos_id, pad_id)
    length = cvalid.sum(1).astype(jnp.int32)  # valid tokens of each row's chunk (0 for done rows)
    last_tok = jnp.take_along_axis(ctoks, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
    new_state = state
    if use_grammar:
      # state after the last valid token of the chunk
      last_st = jnp.take_along_axis(csts, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
      new_state = jnp.where(length > 0, table[jnp.maximum(last_st, 0), last_tok], state)
    positions = jnp.broadcast_to((c["npos"][:, None] + jnp.arange(k))[None], (3, b, k))
    # K = 1: every row writes slot P + i (a finished row's slot is masked out by `cvalid`), so the
    # cache write is one dynamic_update_slice at a scalar index instead of a per-row scatter.
    cursor = p + c["i"] if k == 1 else c["cur"]
    step = model(ctoks, positions, cvalid, cache=c["cache"], cache_index=cursor, decode_weights=decode_weights)
    logits, cache = step.logits, step.cache
    new_last = jnp.take_along_axis(logits, jnp.maximum(length - 1, 0)[:, None, None], axis=1)[:, 0]
    # Write the chunk into the outputs at each row's position (K > 1: invalid entries go out of bounds).
    if k == 1:
      # Lockstep: an unfinished row's next output column is i; a finished row writes PAD / 0 there,
      # which is what it emits after EOS (its state is fixed up after the loop).
      clps = jnp.where(cvalid, clps, 0.0)
      put = lambda buf, x: jax.lax.dynamic_update_slice(buf, x.astype(buf.dtype), (0, c["i"]))
    else:
      idx = jnp.where(cvalid, out[:, None] + jnp.arange(k), n)
      put = lambda buf, x: buf.at[rows[:, None], idx].set(x.astype(buf.dtype), mode="drop")
    return dict(i=c["i"] + 1, cache=cache, last=jnp.where((length > 0)[:, None], new_last, c["last"]),
                state=new_state, done=c["done"] | ((length > 0) & (last_tok == eos_id)),
                out=out + length, cur=c["cur"] + length, npos=c["npos"] + length, key=key,
                toks=put(c["toks"], ctoks), lps=put(c["lps"], clps), states=put(c["states"], csts))

  state0 = start_state.astype(jnp.int32) if use_grammar else jnp.full((b,), -1, jnp.int32)
  init = dict(i=jnp.zeros((), jnp.int32), cache=cache, last=last, state=state0, done=jnp.zeros((b,), bool),
              out=jnp.zeros((b,), jnp.int32), cur=jnp.full((b,), p, jnp.int32),
              npos=next_position(tokens, attn_mask, image_token_id, grid), key=key,
              toks=jnp.full((b, n), pad_id, jnp.int32), lps=jnp.zeros((b, n), jnp.float32),
              states=jnp.full((b, n), -1, jnp.int32))
  c = jax.lax.while_loop(cond, body, init)
  # Positions after a row finished: PAD, log-prob 0, the row's final (done) state.
  after = jnp.arange(n)[None] >= c["out"][:, None]
  states = jnp.where(after, c["state"][:, None], c["states"])
  return Generation(c["toks"], c["lps"], states, c["out"])


# On CPU without YNNPACK fusions: the decode loop's few-row dots run faster on XLA's own kernels
# (`compile_options`, measured there).
GENERATE_STATIC = ("graphdef", "max_new_tokens", "temperature", "top_p", "eos_id", "pad_id", "image_token_id", "chunk")
_generate = compile_options.jit_per_backend(_generate_fn, cpu_options=compile_options.DECODE_CPU_OPTIONS,
                                            static_argnames=GENERATE_STATIC)


def generate(policy, tokens, attn_mask, pixel_values, image_mask, key, *rest, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, grammar_table=None, start_state=None,
             eos_id: int = EOS, pad_id: int = PAD, image_token_id: int | None = None,
             jump_forward: int = 1) -> Generation:
  """Samples up to `max_new_tokens` tokens after LEFT-padded prompts.

  Args:
    policy: a `Policy`; or its `nnx.GraphDef` followed by its params, i.e.
      `generate(graphdef, params, tokens, attn_mask, pixel_values, image_mask, key, ...)` (cheaper:
      no split per call).
    tokens: [B, P] int32 left-padded prompts; attn_mask: [B, P] bool (True = real token).
    pixel_values: [B, M, H, W, 3] float32 in [0, 1] (images of the prompt's IMAGE blocks) or None;
    image_mask: [B, M] bool or None.
    key: PRNG key.
    max_new_tokens: N; temperature: > 0, or 0 for greedy; top_p: nucleus mass (1.0 = plain sampling).
    grammar_table: [S, V] int32 automaton or None; start_state: [B] int32 (required with a table).
    eos_id, pad_id: a row is done after EOS and then emits PAD with log-prob 0 (eos_id = -1: never).
    image_token_id: the placeholder id (None = the model config's `image_token_id`).
    jump_forward: K >= 1 tokens per decode step. With a grammar and K > 1, each step samples one
      token and appends up to K - 1 tokens the grammar then forces (exactly one allowed token:
      probability 1, log-prob 0), running them through the model in one chunk (SGLang's
      "jump-forward" decoding of a compressed FSM). The sampled distribution, the outputs' format
      and the log-probs are those of K = 1; only the number of sequential model calls changes
      (a reply of 47 bytes with 4 free digits takes 5 steps instead of 47 at K = 40).
  Returns:
    `Generation` (see class). Compiles once per (B, P, N, M) shape and sampling settings.
  Raises:
    ValueError: grammar_table without start_state, temperature < 0, or jump_forward < 1.
  """
  if isinstance(policy, nnx.GraphDef):
    graphdef, params = policy, tokens
    tokens, attn_mask, pixel_values, image_mask, (key, *rest) = attn_mask, pixel_values, image_mask, key, rest
  else:
    graphdef, params = nnx.split(policy)
  if rest:
    raise TypeError(f"generate() got {len(rest)} unexpected positional arguments")
  if grammar_table is not None and start_state is None:
    raise ValueError("grammar_table needs start_state")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if jump_forward < 1:
    raise ValueError(f"jump_forward must be >= 1, got {jump_forward}")
  start = None if grammar_table is None else jnp.asarray(start_state, jnp.int32)
  return _generate(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(attn_mask, bool), pixel_values,
                   image_mask, key, grammar_table, start, graphdef=graphdef, max_new_tokens=int(max_new_tokens),
                   temperature=float(temperature), top_p=float(top_p), eos_id=int(eos_id), pad_id=int(pad_id),
                   image_token_id=None if image_token_id is None else int(image_token_id),
                   chunk=int(jump_forward) if grammar_table is not None else 1)
