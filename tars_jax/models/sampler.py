"""KV-cache sampling (jitted prefill + `lax.scan` decode) with temperature, top-p and
grammar-constrained decoding.

Constrained decoding: `grammar_table [S, V] int32` gives the next automaton state for (state, token),
-1 = not allowed (see `tars_jax/agent/grammar.py`). Each step masks the logits to the row's allowed
tokens, samples, and advances the state. The returned log-probs are those of the distribution
actually sampled from — log_softmax((logits / temperature) masked to the allowed set) — which is
exactly what PPO recomputes in training (`rl.losses.masked_log_softmax`). With top_p < 1 the
returned log-probs are still those of the un-truncated constrained distribution (PPO off-policy
caveat; configs keep top_p = 1 for training).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.agent.tokenizer import IMAGE
from tars_jax.models.rope import next_position, rope_positions
from tars_jax.rl.losses import masked_log_softmax


class Generation(NamedTuple):
  tokens: jax.Array  # [B, N] int32 (PAD after EOS)
  logprobs: jax.Array  # [B, N] float32 (0 after EOS)
  states: jax.Array  # [B, N] int32 grammar state before each token (-1 without grammar)
  lengths: jax.Array  # [B] int32 tokens up to and including EOS (N if no EOS)


def _top_p_filter(logp: jax.Array, top_p: float) -> jax.Array:
  """Keeps the smallest set of tokens with cumulative probability >= top_p (others -> -1e9)."""
  sorted_lp = jnp.sort(logp, axis=-1)[..., ::-1]
  cum = jnp.cumsum(jnp.exp(sorted_lp), axis=-1)
  cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
  cutoff = jnp.take_along_axis(sorted_lp, cutoff_idx, axis=-1)
  return jnp.where(logp >= cutoff, logp, -1e9)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_p",
                                             "eos_id", "pad_id", "image_token_id"))
def _generate(params, tokens, attn_mask, pixel_values, key, table, start_state, *, graphdef,
              max_new_tokens, temperature, top_p, eos_id, pad_id, image_token_id):
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  b, p = tokens.shape
  n = max_new_tokens
  s = p + n
  grid = cfg.merged_grid
  attn_mask = attn_mask.astype(bool)
  pos = rope_positions(tokens, attn_mask, image_token_id, grid)
  key_mask = jnp.concatenate([attn_mask, jnp.zeros((b, n), bool)], axis=1)
  cache = model.trunk.init_cache(b, s)
  logits, cache = model.step(tokens, pos, attn_mask, cache, 0, key_mask, pixel_values)
  last = logits[:, -1]  # left padding: the last slot is every row's last real token
  next_pos = next_position(tokens, attn_mask, image_token_id, grid)
  use_grammar = table is not None
  state0 = start_state if use_grammar else jnp.full((b,), -1, jnp.int32)

  def body(carry, i):
    cache, last, state, done, key_mask, npos, key = carry
    key, sub = jax.random.split(key)
    allowed = table[jnp.maximum(state, 0)] >= 0 if use_grammar else None
    logp = masked_log_softmax(last, allowed, temperature)
    sample_lp = _top_p_filter(logp, top_p) if top_p < 1.0 else logp
    tok = jax.random.categorical(sub, sample_lp, axis=-1).astype(jnp.int32)
    tok = jnp.where(done, pad_id, tok)
    lp = jnp.where(done, 0.0, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0])
    st_before = state
    if use_grammar:
      state = jnp.where(done, state, table[jnp.maximum(state, 0), tok])
    new_done = done | (tok == eos_id)
    slot = p + i
    key_mask = key_mask.at[:, slot].set(True)
    positions = jnp.broadcast_to(npos[None, :, None], (3, b, 1))
    logits, cache = model.step(tok[:, None], positions, jnp.ones((b, 1), bool), cache, slot, key_mask)
    carry = (cache, logits[:, -1], state, new_done, key_mask, npos + 1, key)
    return carry, (tok, lp, st_before, done)

  init = (cache, last, state0, jnp.zeros((b,), bool), key_mask, next_pos, key)
  _, (toks, lps, states, was_done) = jax.lax.scan(body, init, jnp.arange(n))
  toks, lps, states, was_done = toks.T, lps.T, states.T, was_done.T
  lengths = jnp.sum(~was_done, axis=1).astype(jnp.int32)
  return Generation(toks, lps, states, lengths)


def generate(graphdef, params, tokens, attn_mask, pixel_values, image_mask, key, *, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, grammar_table=None, start_state=None,
             eos_id: int, pad_id: int, image_token_id: int = IMAGE) -> Generation:
  """Samples up to `max_new_tokens` tokens after LEFT-padded prompts.

  Args:
    graphdef, params: `nnx.split(policy)`.
    tokens: [B, P] int32 left-padded prompts; attn_mask [B, P] bool.
    pixel_values: [B, M, H, W, 3] float32 in [0, 1] (images of the prompt's IMAGE blocks), or None;
    image_mask: [B, M] bool (unused slots are never referenced).
    grammar_table: [S, V] int32 automaton or None; start_state: [B] int32.
  Returns: `Generation` (see class). Compiles once per (B, P, N, M) shape.
  """
  del image_mask
  if grammar_table is not None and start_state is None:
    raise ValueError("grammar_table needs start_state")
  return _generate(params, tokens, attn_mask, pixel_values, key, grammar_table, start_state,
                   graphdef=graphdef, max_new_tokens=max_new_tokens, temperature=float(temperature),
                   top_p=float(top_p), eos_id=eos_id, pad_id=pad_id, image_token_id=image_token_id)
