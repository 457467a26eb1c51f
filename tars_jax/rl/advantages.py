"""Advantage estimators as pure JAX functions over `[B, T]` token arrays.

`mask` is 1 on model-written tokens and 0 on observation / prompt / padding tokens. Token-level GAE
skips masked tokens: on them the running advantage and the next value carry across unchanged, so a
multi-turn trajectory is one MDP over the model's tokens (verl `compute_gae_advantage_return` with a
response mask; tunix `compute_gae_advantages`). UI-TARS-2 report section 2.5.4 (decoupled and
length-adaptive GAE, from VC-PPO and VAPO).

Everything here is jittable and vmappable (no Python branching on values), float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Mean of x over entries where mask = 1 (0 where there are none).

  Args:
    x: float array; mask: {0, 1} array (bool or float) broadcastable to x.shape.
    axis: None (all axes) or the axes to reduce, as in `jnp.sum`.
  Returns:
    float32 array of x.shape without `axis`. Source: verl `verl/utils/torch_functional.py:masked_mean`.
  """
  x = _f32(x)
  mask = jnp.broadcast_to(_f32(mask), x.shape)
  return (x * mask).sum(axis) / jnp.maximum(mask.sum(axis), 1e-8)


def masked_var(x: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
  """Variance of x over all entries where mask = 1; scalar float32.

  unbiased=True applies Bessel's correction n / (n - 1) like verl `masked_var`. Where verl raises
  (n <= 1), this returns the biased value instead (0 for n = 1, 0 for n = 0) so it stays jittable.
  """
  x = _f32(x)
  mask = jnp.broadcast_to(_f32(mask), x.shape)
  mean = masked_mean(x, mask)
  var = masked_mean((x - mean) ** 2, mask)
  if unbiased:
    n = mask.sum()
    var = var * jnp.where(n > 1, n / jnp.maximum(n - 1, 1.0), 1.0)
  return var


def masked_whiten(x: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
  """(x - mean) / sqrt(var + 1e-8) with mean and unbiased var over masked entries.

  Returns an array of x.shape (float32); unmasked entries are transformed too (multiply by the mask
  if they must be 0). shift_mean=False adds the mean back (scale only). Source: verl `masked_whiten`.
  """
  x = _f32(x)
  mean, var = masked_mean(x, mask), masked_var(x, mask)
  w = (x - mean) * jax.lax.rsqrt(var + 1e-8)
  return w if shift_mean else w + mean


def _per_row(v, b: int) -> jax.Array:
  return jnp.broadcast_to(_f32(v), (b,))


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma, lam, next_row=None
        ) -> tuple[jax.Array, jax.Array]:
  """Token-level GAE that skips masked tokens, as a reverse `jax.lax.scan` over time.

  Going backwards over t:  delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next;
  then, only where mask_t = 1, V_next <- V_t and A_next <- A_t (on masked tokens both carry across,
  so the TD error of the last token of a turn bootstraps from the first token of the next turn).
  The value after the last position is 0 (the sequence ends the episode); rewards on masked tokens
  are ignored (put each turn's reward on one of its model-written tokens, e.g. its EOS).

  Args:
    rewards, values, mask: [B, T] (cast to float32). values[t] = V(state before token t).
    gamma, lam: python floats, scalars, or per-sequence [B] arrays.
    next_row: None (each row is a whole episode), or [B] int: the row that continues row b's episode
      (its next model tokens; -1 = none). Then the value and advantage after a row's last model token
      are those of the first model token of `next_row` instead of 0 (`chained_gae`); an episode cut
      into rows (`agent/trajectory.py`, memory) gets the advantages of one row holding all its model
      tokens. Rows in a chain must each have a model token; chains must not loop.
  Returns:
    (advantages, returns), [B, T] float32, returns = advantages + values; no whitening.
    At masked positions the advantage is the carried one (that of the next model token, 0 after the
    last one), exactly as verl; multiply by the mask if you need zeros there.
  Source: Schulman et al. 2016 (arXiv 1506.02438) eq. 16; masking as verl
    `verl/trainer/ppo/core_algos.py:compute_gae_advantage_return`.
  """
  if next_row is not None:
    return chained_gae(rewards, values, mask, gamma, lam, next_row)
  rewards, values, mask = _f32(rewards), _f32(values), _f32(mask)
  b = rewards.shape[0]
  return _gae_scan(rewards, values, mask, _per_row(gamma, b), _per_row(lam, b),
                   jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.float32))


def _gae_scan(rewards, values, mask, gamma, lam, next_value0, adv0):
  """The reverse scan of `gae` from the carry (next_value0, adv0) [B] after the last position."""

  def step(carry, xs):
    next_value, last_gae = carry
    r, v, m = xs
    delta = r + gamma * next_value - v
    gae_t = delta + gamma * lam * last_gae
    next_value = v * m + (1 - m) * next_value
    last_gae = gae_t * m + (1 - m) * last_gae
    return (next_value, last_gae), last_gae

  _, adv = jax.lax.scan(step, (next_value0, adv0), (rewards.T, values.T, mask.T), reverse=True)
  adv = adv.T
  return adv, adv + values


def chained_gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma, lam, next_row
                ) -> tuple[jax.Array, jax.Array]:
  """`gae` over episodes laid out as chains of rows: row b continues in row `next_row[b]` (-1: the
  episode ends with row b). Shapes, masking and returns as `gae`; next_row [B] int.

  The carry after a row's last position is (value, advantage) of the next row's first model token,
  so at every model token the result equals `gae` over one row holding the episode's model tokens in
  order (observation tokens only carry, whatever row they are in). Computed as a fixed point: each
  pass re-runs the scan with the advantages of the previous pass at the rows' first model tokens,
  until they stop changing (at most the longest chain + 1 passes; a chain of length n is exact
  after n passes). Source: `gae` (Schulman et al. 2016), verl multi-turn masking; the chaining is
  this project's (agent/trajectory.py, memory).
  """
  rewards, values, mask = _f32(rewards), _f32(values), _f32(mask)
  b = rewards.shape[0]
  gamma, lam = _per_row(gamma, b), _per_row(lam, b)
  nxt = jnp.asarray(next_row, jnp.int32)
  linked = nxt >= 0
  nidx = jnp.where(linked, nxt, 0)
  rows = jnp.arange(b)
  first = jnp.argmax(mask > 0, axis=1)  # first model token of each row
  boot_v = jnp.where(linked, values[rows, first][nidx], 0.0)

  def run(a_first):
    adv, _ = _gae_scan(rewards, values, mask, gamma, lam, boot_v, jnp.where(linked, a_first[nidx], 0.0))
    return adv, adv[rows, first]

  def cond(c):
    i, prev, cur, _ = c
    return (i <= b) & jnp.any(prev != cur)

  def body(c):
    i, _, cur, _ = c
    adv, nxt_first = run(cur)
    return i + 1, cur, nxt_first, adv

  adv0, a1 = run(jnp.zeros((b,), jnp.float32))
  # prev = NaN forces the second pass whatever a1 is (NaN != anything)
  _, _, _, adv = jax.lax.while_loop(cond, body, (jnp.int32(1), jnp.full((b,), jnp.nan), a1, adv0))
  return adv, adv + values


def length_adaptive_lambda(lengths: jax.Array, alpha: float) -> jax.Array:
  """VAPO length-adaptive λ_policy = 1 - 1 / (alpha * length), clipped to [0, 1].

  Args:
    lengths: [B] number of model-written tokens per sequence (e.g. `mask.sum(-1)`); 0 gives λ = 0.
    alpha: VAPO's α (the paper uses 0.05).
  Returns: [B] float32. Source: VAPO (arXiv 2504.05118) section 4.2.
  """
  lengths = _f32(lengths)
  return jnp.clip(1.0 - 1.0 / jnp.maximum(alpha * lengths, 1e-8), 0.0, 1.0)


def decoupled_gae(rewards, values, mask, gamma, lam_policy, lam_critic, next_row=None
                  ) -> tuple[jax.Array, jax.Array]:
  """Decoupled GAE: (advantages computed with lam_policy, returns computed with lam_critic).

  Shapes, masking and `next_row` (episodes cut into chained rows) as `gae`; each λ a scalar or a [B]
  array (e.g. `length_adaptive_lambda`; equal on the rows of one episode).
  Source: VC-PPO (arXiv 2503.01491) section 4.2 — λ_critic = 1 gives unbiased value targets.
  """
  adv, _ = gae(rewards, values, mask, gamma, lam_policy, next_row)
  _, ret = gae(rewards, values, mask, gamma, lam_critic, next_row)
  return adv, ret


def task_centered(adv: jax.Array, weights: jax.Array, row_task: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Advantages with a per-task baseline: each row's advantages minus the mean advantage of its task.

  The mean is over every token of every row of the task, weighted by `weights` (the free decisions),
  so a task whose episodes all do worse (or better) than a critic's estimate loses that offset and
  keeps only the differences between its own episodes: the between-task part of the advantage that a
  critic which does not tell the tasks apart leaves in (benchmarks/RESULTS.md, "What the multi-turn
  suite's critic knows"), as a group baseline removes it per screen (`grpo_advantages`), here per task.
  Args:
    adv: [B, T] float32 advantages (before whitening); weights: [B, T] float32 (0 / 1 mask);
    row_task: [B] int task id of each row (any ints; < 0 = no task, e.g. a padding row: unchanged).
  Returns: (centered [B, T] float32 = adv - offset[:, None], offset [B] float32 = the row's task mean,
    0 for rows without a task or a task without weighted tokens).
  """
  adv, weights = _f32(adv), _f32(weights)
  ids = jnp.asarray(row_task)
  b = adv.shape[0]
  seg = _dense_segments(ids)
  tot = jax.ops.segment_sum((adv * weights).sum(-1), seg, b)
  cnt = jax.ops.segment_sum(weights.sum(-1), seg, b)
  offset = jnp.where((ids >= 0) & (cnt[seg] > 0), tot[seg] / jnp.maximum(cnt[seg], 1e-9), 0.0)
  return adv - offset[:, None], offset


def _dense_segments(ids: jax.Array) -> jax.Array:
  """[B] int ids in [0, B): equal ids get equal segments, with a static output size, so arbitrary ids
  (prompt hashes, task ids, -1 for padding) jit and index `jax.ops.segment_sum(..., num_segments=B)`."""
  b = ids.shape[0]
  _, seg = jnp.unique(jnp.asarray(ids), return_inverse=True, size=b)
  return seg.reshape(b)


def _group_stats(scores: jax.Array, group_ids: jax.Array):
  """Per-element (group size, group sum, group mean, unbiased group std); any int ids allowed."""
  b = scores.shape[0]
  seg = _dense_segments(group_ids)
  cnt = jax.ops.segment_sum(jnp.ones_like(scores), seg, b)[seg]
  s = jax.ops.segment_sum(scores, seg, b)[seg]
  mean = s / cnt
  sq = jax.ops.segment_sum((scores - mean) ** 2, seg, b)[seg]
  std = jnp.sqrt(sq / jnp.maximum(cnt - 1, 1))  # torch.std (Bessel) as verl
  return cnt, s, mean, std


def group_sizes(group_ids: jax.Array) -> jax.Array:
  """[B] int32: the number of elements sharing each element's group id (any int ids).

  A group-relative baseline needs size >= 2; callers drop elements of size-1 groups (e.g. a group
  whose other episodes were lost) instead of training on their raw score.
  """
  ids = jnp.asarray(group_ids)
  cnt, _, _, _ = _group_stats(jnp.zeros(ids.shape, jnp.float32), ids)
  return cnt.astype(jnp.int32)


def grpo_advantages(scores: jax.Array, group_ids: jax.Array, eps: float = 1e-6,
                    normalize_std: bool = True) -> jax.Array:
  """GRPO outcome advantages: (score - group mean) / (unbiased group std + eps).

  Args:
    scores: [B] float32 sequence scores; group_ids: [B] int (rollouts of one prompt share an id;
      any int values).
    normalize_std: False gives Dr.GRPO (arXiv 2503.20783): score - group mean.
  Returns: [B] float32 (broadcast to tokens with `adv[:, None] * mask`). A group of one keeps its raw
    score (mean 0, std 1) as verl does.
  Source: verl `core_algos.compute_grpo_outcome_advantage`.
  """
  scores = _f32(scores)
  cnt, _, mean, std = _group_stats(scores, group_ids)
  single = cnt < 2
  mean, std = jnp.where(single, 0.0, mean), jnp.where(single, 1.0, std)
  a = scores - mean
  return a / (std + eps) if normalize_std else a


def rloo_advantages(scores: jax.Array, group_ids: jax.Array) -> jax.Array:
  """RLOO advantages: score minus the mean score of the *other* members of its group.

  scores: [B] float32, group_ids: [B] int. Returns [B] float32; a group of one keeps its raw score
  (verl's convention). Source: arXiv 2402.14740; verl `core_algos.compute_rloo_outcome_advantage`.
  """
  scores = _f32(scores)
  cnt, s, _, _ = _group_stats(scores, group_ids)
  loo_mean = (s - scores) / jnp.maximum(cnt - 1, 1)
  return jnp.where(cnt > 1, scores - loo_mean, scores)
