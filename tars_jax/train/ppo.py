"""PPO update for a token-level policy and critic over multi-turn episodes (functional, jitted).

Pipeline of one iteration (UI-TARS-2 report section 2.5.4; verl `ray_trainer` ordering):
  critic values of the rollout batch -> GAE over model tokens (observation tokens skipped) ->
  advantage whitening -> `epochs` x minibatches of clipped policy + clipped value updates.

`algo` other than "ppo" ("grpo", "drgrpo", "rloo"; the report's PPO-vs-GRPO comparison) replaces the
critic by group-relative outcome advantages over episodes that share a task and seed (the same
screen), broadcast to every model-written token; groups whose episodes all score the same carry no
signal and are left out of the update (DAPO's dynamic-sampling filter, arXiv 2503.14476), as are
groups left with one episode (no baseline).

The policy log-probs are those of the grammar-constrained, temperature-scaled distribution the
sampler drew from (`models.inference.sampler.generate`), rebuilt here from the grammar states of the batch.

Grammar-forced tokens (one allowed token: log-prob 0, entropy 0, zero gradient; e.g. the fixed third
digit of a 'tens3' coordinate, `Action: click(start_box='(`) are not decisions: the policy and KL
losses, their token-mean denominators, the entropy mean, advantage whitening and VAPO's length count
only free decisions (`free_decisions`). GAE itself still runs over every model token (rewards sit
on the reply's EOS, which is usually forced) and the critic is fitted on every model token.

Memory (`agent/memory.py`): when the agent's prompts were rebuilt (working memory, token budget), a
batch holds several rows per episode (`trajectory.collate`: `row_episode`, `next_row`), each the
exact prompt + replies the policy saw. GAE then chains the rows of an episode (`rl.advantages.gae`
with `next_row`), VAPO's length counts the episode's free decisions over all its rows, and the
group-relative algos give every row its episode's advantage; `n_real`, `scores` and `group_ids`
still count episodes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tars_jax.agent.trajectory import half_octave_bucket, pow2_bucket
from tars_jax.distributed import to_host
from tars_jax.models.inference import sampler
from tars_jax.rl import advantages as adv_lib
from tars_jax.rl import losses
from tars_jax.rl import metrics as rl_metrics
from tars_jax.rl import typed_text
from tars_jax.rl.checks import check_finite
from tars_jax.train import sft as sft_lib
from tars_jax.train import step as step_lib
from tars_jax.train.step import ModelInputs


@dataclasses.dataclass(frozen=True)
class PPOHparams:
  """Static hyper-parameters of the update (hashable: part of the jit cache key).

  No field has a default: a run builds them from its config (`train.state.hparams`), the one place
  defaults live; tests pass every field.
  length_adaptive_alpha: None, or VAPO's alpha: then lam_policy of each sequence is
    `length_adaptive_lambda(number of its model tokens, alpha)` instead of `lam_policy`.
  value_clip: None (off) or the PPO value-clip range; clip_c: None (off) or the dual-clip constant.
  decoupled: the decoupled PPO objective (`losses.decoupled_ppo_policy_loss`): ratio to the policy
    before this update, behaviour log-probs (`old_logp`) only in an importance weight; for stale
    streaming rollouts (`rollout/pool.py`). False: the clipped ratio pi_theta / pi_behaviour.
  behaviour_weight_cap: with `decoupled`, tokens whose importance weight pi_prox / pi_behaviour
    exceeds it leave the loss (AReaL's behav_imp_weight_cap); None keeps every token.
  kl_kind, kl_coef: KL(policy || reference) penalty added to the policy loss as
    kl_coef * aggregate(kl_penalty(logp, ref_logp, kl_kind)) (verl `use_kl_loss`); the reference is
    the initial policy (`ppo_update(ref_params=...)`); kl_coef = 0 turns it off.
  top_entropy_frac: the policy gradient only on the highest-entropy fraction of each minibatch's free
    decisions (`losses.top_entropy_mask`, Wang et al. 2025); 1.0 = every free decision. Entropy bonus
    and KL term keep every free decision.
  ptx_coef: PPO-ptx (Ouyang et al. 2022, eq. 2): each policy step also descends ptx_coef x the SFT
    cross-entropy (`sft.loss_and_metrics`) of a batch of demonstrations (`ppo_update(ptx_batches=...)`);
    0 = off.
  freeze_vision: the vision encoders of policy and critic are not trained: `ppo_update` computes each
    model's screenshot features once per rollout batch (`step.image_features`) and every forward pass
    of the update takes them as constants, so no minibatch step runs an encoder forward or backward;
    the encoders' parameters stay exactly where they are (`keep_frozen` after each step: weight decay
    and PPO-ptx's gradient included). False trains them.
  task_baseline: PPO only: before whitening, each episode's advantages lose the mean advantage of its
    task's episodes in the batch (`advantages.task_centered`, over free decisions): a per-task
    baseline on top of the critic's, for a critic that does not yet tell the tasks apart (`prepare`
    logs the offset it removes, `advantage_task_offset`, whether on or off). Needs `ppo_update(task_ids=)`.
  skip_typed_text: the policy gradient leaves out the characters a `type(content='...')` reply types
    (`rl.typed_text.typed_text_targets`; byte tokenizer only): RL then moves the actions and where they
    point, never the copied text itself (an ablation, issue #37 item 4). Entropy bonus and KL term keep
    every free decision.
  Raises: ValueError for unknown algo / loss_agg / kl_kind names (listing the known ones) and for
    out-of-range constants.
  """

  algo: str
  gamma: float
  lam_policy: float
  lam_critic: float
  length_adaptive_alpha: float | None
  whiten_advantages: bool
  clip_low: float
  clip_high: float
  clip_c: float | None
  value_clip: float | None
  vf_coef: float
  ent_coef: float
  aux_loss_coef: float
  loss_agg: str
  kl_kind: str
  kl_coef: float
  decoupled: bool
  behaviour_weight_cap: float | None
  top_entropy_frac: float
  ptx_coef: float
  freeze_vision: bool
  temperature: float
  skip_typed_text: bool
  task_baseline: bool

  def __post_init__(self):
    if self.algo not in ALGOS:
      raise ValueError(f"unknown rl.algo {self.algo!r}; expected one of {ALGOS}")
    if self.loss_agg not in losses.AGG_MODES:
      raise ValueError(f"unknown rl.loss_agg {self.loss_agg!r}; expected one of {losses.AGG_MODES}")
    if losses._KL_ALIASES.get(self.kl_kind, self.kl_kind) not in losses.KL_KINDS:
      raise ValueError(f"unknown rl.kl_kind {self.kl_kind!r}; expected one of {losses.KL_KINDS}")
    if self.clip_c is not None and self.clip_c <= 1.0:
      raise ValueError(f"rl.clip_c must be > 1 (or None), got {self.clip_c}")
    if self.length_adaptive_alpha is not None and self.length_adaptive_alpha <= 0:
      raise ValueError(f"rl.length_adaptive_alpha must be > 0 (or None), got {self.length_adaptive_alpha}")
    for name in ("gamma", "lam_policy", "lam_critic"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"rl.{name} must be in [0, 1], got {getattr(self, name)}")
    if self.kl_coef < 0:
      raise ValueError(f"rl.kl_coef must be >= 0, got {self.kl_coef}")
    if self.ptx_coef < 0:
      raise ValueError(f"rl.ptx_coef must be >= 0, got {self.ptx_coef}")
    if not 0.0 < self.top_entropy_frac <= 1.0:
      raise ValueError(f"rl.top_entropy_frac must be in (0, 1], got {self.top_entropy_frac}")
    if self.behaviour_weight_cap is not None and self.behaviour_weight_cap <= 1.0:
      raise ValueError(f"rl.behaviour_weight_cap must be > 1 (or None), got {self.behaviour_weight_cap}")


ALGOS = ("ppo", "grpo", "drgrpo", "rloo")
FROZEN_VISION = ("visual",)  # the vision encoder's module name in `models.policy.Trunk`
# Where `ppo_update` keeps each model's precomputed screenshot features under `freeze_vision`.
POLICY_FEATURES, CRITIC_FEATURES = "policy_image_features", "critic_image_features"
TYPED_TEXT = "typed_text"  # [B, T-1] float32 of `ppo_update` under skip_typed_text: 1 = a typed character


def make_optimizer(lr: float, warmup_steps: int, max_grad_norm: float, weight_decay: float
                   ) -> optax.GradientTransformation:
  """Global-norm clipping + AdamW with linear warm-up to a constant `lr`: step k (from 0) uses
  lr * min(1, (k + 1) / warmup_steps), so the first step already moves the parameters."""
  w = max(1, warmup_steps)
  sched = lambda step: lr * jnp.minimum(1.0, (step + 1) / w)  # noqa: E731
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(sched, b1=0.9, b2=0.999, weight_decay=weight_decay))


def keep_frozen(new, old, frozen: tuple[str, ...] = FROZEN_VISION):
  """`new` (an nnx.State or nested dict of parameters) with the leaves inside a module named in
  `frozen` taken from `old`: a step that must not move those parameters, whatever the optimiser
  does to them (weight decay, PPO-ptx's gradient). The optimiser state keeps its structure, so
  checkpoints of runs with and without frozen modules restore into each other."""
  return jax.tree_util.tree_map_with_path(
      lambda path, n, o: o if any(getattr(k, "key", None) in frozen for k in path) else n, new, old)


def frozen_features(batch: dict, key: str, hp: PPOHparams):
  """The screenshot features `ppo_update` stored under `key` (`POLICY_FEATURES` / `CRITIC_FEATURES`)
  when `hp.freeze_vision`, else None (the model runs its own encoder): `step.forward`'s image_features."""
  return batch[key] if hp.freeze_vision else None


def free_decisions(table, states, mask) -> jax.Array:
  """[B, T] float32: `mask` where the grammar allowed more than one token (a sampled decision), 0 on
  grammar-forced tokens and outside the mask (`losses.decision_mask`).

  table: [S, V] int32 grammar table (-1 = not allowed) or None (unconstrained: every masked token is
  a decision); states: [B, T] int32 grammar state before each target token; mask: [B, T].
  """
  if table is None:
    return losses.decision_mask(mask, None)
  num_allowed = (jnp.asarray(table) >= 0).sum(-1)  # [S]: per state, so a gather instead of [B,T,V]
  return losses.decision_mask(mask, num_allowed[states])


def critic_values(critic_gd, critic_params, batch: dict, inputs: ModelInputs, image_features=None) -> jax.Array:
  """Values of the prefix ending at each input token j, i.e. V(s) before target token j+1.

  Returns [B, T-1] float32. image_features: as `step.forward`'s (the critic's own encoder's).
  """
  values, _ = step_lib.forward(critic_gd, critic_params, batch, inputs, image_features)
  return values[:, :-1]


def policy_lambda(free: jax.Array, hp: PPOHparams, row_episode: jax.Array | None = None) -> jax.Array:
  """[B] lam_policy per sequence: VAPO's 1 - 1/(alpha * free decisions) if `length_adaptive_alpha`
  is set, else the constant `lam_policy`. free: [B, T] mask of sampled decisions (`free_decisions`;
  forced tokens are not part of the length). row_episode: None, or [B] int episode of each row (-1
  padding; `trajectory.Batch`): the length is then the episode's, summed over its rows."""
  if hp.length_adaptive_alpha is None:
    return jnp.full((free.shape[0],), hp.lam_policy, jnp.float32)
  lengths = free.sum(-1)
  if row_episode is not None:
    b = lengths.shape[0]
    seg = jnp.where(row_episode >= 0, row_episode, b)  # padding rows share one extra segment
    lengths = jax.ops.segment_sum(lengths, seg, b + 1)[seg]
  return adv_lib.length_adaptive_lambda(lengths, hp.length_adaptive_alpha)


def raw_advantages(values: jax.Array, batch: dict, hp: PPOHparams, free: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """(advantages, returns), [B,T-1] float32 zeroed off `loss_mask`, before whitening: decoupled
  lambdas (VC-PPO) and, optionally, length-adaptive lam_policy (VAPO) from the free-decision count
  of `free` [B,T-1]; report section 2.5.4."""
  mask = batch["loss_mask"]
  if "next_row" in batch:  # episodes cut into chained rows (memory): GAE carries across the rows
    lam = policy_lambda(free, hp, batch["row_episode"])
    adv, ret = adv_lib.decoupled_gae(batch["rewards"], values, mask, hp.gamma, lam, hp.lam_critic,
                                     next_row=batch["next_row"])
  else:
    adv, ret = adv_lib.decoupled_gae(batch["rewards"], values, mask, hp.gamma, policy_lambda(free, hp),
                                     hp.lam_critic)
  return adv * mask, ret * mask


def _whiten(adv: jax.Array, mask: jax.Array, free: jax.Array, hp: PPOHparams) -> jax.Array:
  # Statistics over free decisions only: forced tokens carry no gradient and would bias mean and std.
  return adv_lib.masked_whiten(adv, free) * mask if hp.whiten_advantages else adv


def compute_advantages(values: jax.Array, batch: dict, hp: PPOHparams, free: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
  """(advantages [B,T-1], returns [B,T-1]) float32: `raw_advantages`, whitened over the free
  decisions `free` [B,T-1] if `hp.whiten_advantages`."""
  adv, ret = raw_advantages(values, batch, hp, free)
  return _whiten(adv, batch["loss_mask"], free, hp), ret


def _token_logp(params, gd, table, mb, hp: PPOHparams, inputs: ModelInputs):
  """(log-probs [B,T-1] float32 of the target tokens under the distribution the sampler drew from
  (`sampler.token_logprobs`: grammar-masked, temperature-scaled), logits [B,T-1,V] float32, allowed
  [B,T-1,V] bool or None, MoE aux loss, fraction of MoE top-k assignments dropped over expert
  capacity (0 unless `moe_capacity_factor`))."""
  logits, aux, _, st = step_lib.forward(gd, params, mb, inputs, frozen_features(mb, POLICY_FEATURES, hp),
                                        moe_stats=True)
  dropped = st["moe_dropped"] / jnp.maximum(st["moe_assignments"], 1.0)
  logits = logits[:, :-1].astype(jnp.float32)
  allowed = step_lib.allowed_tokens(table, mb["states"], mb["loss_mask"])
  # The sampler's own function: the ratio's denominator (old_logp) came from the same formula.
  logp = sampler.token_logprobs(logits, mb["tokens"][:, 1:], allowed, hp.temperature)
  return logp, logits, allowed, aux, dropped


def policy_loss(params, gd, table, mb, hp: PPOHparams, inputs: ModelInputs):
  """(loss scalar, metrics) of one PPO / GRPO minibatch: the clipped (or decoupled) surrogate on free
  decisions, minus ent_coef * entropy, plus the MoE aux loss and the KL-to-reference term."""
  logp, logits, allowed, aux, dropped = _token_logp(params, gd, table, mb, hp, inputs)
  # Forced tokens have zero gradient anyway; leaving them out of the mask keeps them out of the
  # token-mean denominators, the entropy mean and the clip / KL statistics.
  free = free_decisions(table, mb["states"], mb["loss_mask"])
  tok_ent = losses.entropy(logits, free, allowed, hp.temperature)
  pg_mask = losses.top_entropy_mask(tok_ent, free, hp.top_entropy_frac)
  if hp.skip_typed_text:
    pg_mask = pg_mask * (1.0 - mb[TYPED_TEXT])
  if hp.decoupled:  # trust region around the pre-update policy; behaviour policy as importance weight
    pg, m = losses.decoupled_ppo_policy_loss(logp, mb["prox_logp"], mb["old_logp"], mb["advantages"], pg_mask,
                                             hp.clip_low, hp.clip_high, hp.clip_c, hp.loss_agg,
                                             hp.behaviour_weight_cap)
  else:
    pg, m = losses.ppo_policy_loss(logp, mb["old_logp"], mb["advantages"], pg_mask, hp.clip_low,
                                   hp.clip_high, hp.clip_c, hp.loss_agg)
  ent = losses.aggregate(tok_ent, free, "token-mean")
  loss = pg - hp.ent_coef * ent + hp.aux_loss_coef * aux
  m = dict(m, pg_loss=pg, entropy=ent, moe_aux_loss=aux, moe_dropped_frac=dropped)
  if hp.top_entropy_frac < 1.0 or hp.skip_typed_text:
    m["pg_token_frac"] = pg_mask.sum() / jnp.maximum(free.sum(), 1.0)
  if hp.kl_coef > 0:  # KL to the reference (initial) policy as a loss term (verl use_kl_loss)
    kl = losses.aggregate(losses.kl_penalty(logp, mb["ref_logp"], hp.kl_kind), free, hp.loss_agg)
    loss = loss + hp.kl_coef * kl
    m["kl_ref"] = kl
  return loss, m


@functools.partial(jax.jit, static_argnames=("policy_gd", "hp", "inputs"))
def reference_logp(ref_params, batch: dict, table, *, policy_gd, hp: PPOHparams, inputs: ModelInputs) -> jax.Array:
  """[B, T-1] log-probs of the batch's target tokens under the policy `ref_params` (jitted): the KL
  reference, or the proximal policy of the decoupled objective (the params before the update)."""
  return _token_logp(ref_params, policy_gd, table, batch, hp, inputs)[0] * batch["loss_mask"]


def critic_loss(params, gd, mb, hp: PPOHparams, inputs: ModelInputs):
  """(vf_coef * clipped value loss + MoE aux loss, metrics) of one critic minibatch."""
  values, aux = step_lib.forward(gd, params, mb, inputs, frozen_features(mb, CRITIC_FEATURES, hp))
  vl, m = losses.value_loss(values[:, :-1], mb["old_values"], mb["returns"], mb["loss_mask"],
                            hp.value_clip, hp.loss_agg)
  return hp.vf_coef * vl + hp.aux_loss_coef * aux, dict(m, value_loss=vl)


@functools.partial(jax.jit, static_argnames=("policy_gd", "hp", "inputs"))
def ptx_gradients(params, batch: dict, table, *, policy_gd, hp: PPOHparams, inputs: ModelInputs):
  """PPO-ptx's demonstration term at `params` (jitted, one compile per demonstration batch shape):
  (gradient tree of hp.ptx_coef x the SFT cross-entropy of `batch` under the grammar `table`, metrics
  ptx_ce / ptx_ce_free (nats per reply token / per free decision) and ptx_acc_free).
  batch: a collated demonstration batch (`sft.demo_batches`: tokens [B, T] int32, loss_mask / states
  [B, T-1], pixel_values [B, M, H, W, 3] float32, image_mask [B, M] bool). With hp.freeze_vision the
  screenshots' features enter as constants: no encoder backward for a gradient `keep_frozen` drops."""
  feats = (step_lib.image_features(policy_gd, params, batch["pixel_values"], batch["image_mask"])
           if hp.freeze_vision else None)

  def loss_fn(p):
    ce, m = sft_lib.loss_and_metrics(p, batch, table, graphdef=policy_gd, inputs=inputs, aux_coef=0.0,
                                     image_features=feats)
    return hp.ptx_coef * ce, {"ptx_ce": m["ce"], "ptx_ce_free": m["ce_free"], "ptx_acc_free": m["acc_free"]}
  (_, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return g, m


def _policy_update(state: dict, mb: dict, table, policy_gd, popt, hp: PPOHparams, inputs: ModelInputs,
                   ptx_grads=None) -> tuple[dict, dict]:
  loss_fn = lambda p: policy_loss(p, policy_gd, table, mb, hp, inputs)  # noqa: E731
  params, opt_state, _, pm, gnorm = step_lib.apply_gradients(loss_fn, state["policy"], state["policy_opt"], popt,
                                                             extra_grads=ptx_grads)
  if hp.freeze_vision:
    params = keep_frozen(params, state["policy"])
  return dict(state, policy=params, policy_opt=opt_state), dict(pm, policy_grad_norm=gnorm)


def critic_update(state: dict, mb: dict, critic_gd, copt, hp: PPOHparams, inputs: ModelInputs) -> tuple[dict, dict]:
  """The critic's `step_lib.apply_gradients` on one minibatch (needs mb old_values, returns): (state
  with new critic and critic_opt, metrics + critic_grad_norm). Traced inside the caller's jit."""
  loss_fn = lambda p: critic_loss(p, critic_gd, mb, hp, inputs)  # noqa: E731
  params, opt_state, _, vm, gnorm = step_lib.apply_gradients(loss_fn, state["critic"], state["critic_opt"], copt)
  if hp.freeze_vision:
    params = keep_frozen(params, state["critic"])
  return dict(state, critic=params, critic_opt=opt_state), dict(vm, critic_grad_norm=gnorm)


@functools.partial(jax.jit, static_argnames=("policy_gd", "critic_gd", "popt", "copt", "hp", "inputs"),
                   donate_argnames=("state",))
def minibatch_step(state: dict, mb: dict, table, ptx_grads=None, *, policy_gd, critic_gd, popt, copt,
                   hp: PPOHparams, inputs: ModelInputs):
  """One PPO step on a minibatch, policy and critic in one program: returns (new state, metrics dict
  of scalars). `state` = {"step", "policy", "critic", "policy_opt", "critic_opt"} (nnx.State / optax
  pytrees); ptx_grads: None, or `ptx_gradients` at state["policy"], added to the policy's gradient."""
  new, pm = _policy_update(state, mb, table, policy_gd, popt, hp, inputs, ptx_grads)
  new, vm = critic_update(new, mb, critic_gd, copt, hp, inputs)
  return dict(new, step=state["step"] + 1), dict(pm, **vm)


@functools.partial(jax.jit, static_argnames=("policy_gd", "popt", "hp", "inputs"), donate_argnames=("state",))
def policy_step(state: dict, mb: dict, table, ptx_grads=None, *, policy_gd, popt, hp: PPOHparams,
                inputs: ModelInputs):
  """One clipped policy-gradient step without a critic (group-relative algos); (state, metrics).
  ptx_grads as in `minibatch_step`."""
  new, pm = _policy_update(state, mb, table, policy_gd, popt, hp, inputs, ptx_grads)
  return dict(new, step=state["step"] + 1), pm


def outcome_advantages(scores: np.ndarray, group_ids: np.ndarray, algo: str) -> np.ndarray:
  """Episode-level advantages [B] float32 of a group-relative `algo` from scores [B] and ids [B].

  grpo: (s - mean) / (std + eps); drgrpo: s - mean (arXiv 2503.20783); rloo: s - mean of the others.
  Raises: ValueError for an unknown algo (or "ppo", which uses the critic instead).
  """
  s, g = jnp.asarray(scores, jnp.float32), jnp.asarray(group_ids)
  if algo == "grpo":
    a = adv_lib.grpo_advantages(s, g)
  elif algo == "drgrpo":
    a = adv_lib.grpo_advantages(s, g, normalize_std=False)
  elif algo == "rloo":
    a = adv_lib.rloo_advantages(s, g)
  else:
    raise ValueError(f"no outcome advantages for algo {algo!r}; expected one of {ALGOS[1:]}")
  return np.asarray(a, np.float32)


@functools.partial(jax.jit, static_argnames=("critic_gd", "hp", "inputs"))
def prepare(critic_params, batch: dict, table=None, row_task=None, *, critic_gd, hp: PPOHparams,
            inputs: ModelInputs):
  """Values, advantages, returns [B,T-1] float32 and diagnostics of a rollout batch (jitted).

  table: the grammar table the batch was sampled under ([S, V] int32), or None (unconstrained, or a
  caller that needs only values and returns, which do not depend on it). row_task: None, or [B] int
  task id of each row (-1 for padding rows): `hp.task_baseline` needs it. Diagnostics:
  explained_variance, value_return_corr, value_mean, return_mean (over model tokens);
  lam_policy_mean (over episodes); advantage_abs_mean (mean |A| before whitening over free
  decisions, after the task baseline) and informative_fraction (`rl.metrics.informative_fraction` of
  the same advantages); with row_task, advantage_task_offset: the mean over free decisions of |the
  mean advantage of the token's task| before the task baseline (0 when the critic's values leave no
  task better or worse off than expected).
  Raises: ValueError if `hp.task_baseline` and row_task is None.
  """
  values = critic_values(critic_gd, critic_params, batch, inputs, frozen_features(batch, CRITIC_FEATURES, hp))
  mask = batch["loss_mask"]
  free = free_decisions(table, batch["states"], mask)
  raw, ret = raw_advantages(values, batch, hp, free)
  diag = {}
  if row_task is not None:
    centered, offset = adv_lib.task_centered(raw, free, row_task)
    diag["advantage_task_offset"] = adv_lib.masked_mean(jnp.broadcast_to(jnp.abs(offset)[:, None], free.shape), free)
    if hp.task_baseline:
      raw = centered * mask
  elif hp.task_baseline:
    raise ValueError("rl.task_baseline needs the task of every row (ppo_update(task_ids=...))")
  adv = _whiten(raw, mask, free, hp)
  diag.update(explained_variance=rl_metrics.explained_variance(ret, values, mask),
              value_return_corr=rl_metrics.masked_corr(values, ret, mask),
              value_mean=adv_lib.masked_mean(values, mask), return_mean=adv_lib.masked_mean(ret, mask),
              advantage_abs_mean=adv_lib.masked_mean(jnp.abs(raw), free),
              informative_fraction=rl_metrics.informative_fraction(raw, free))
  rows = (free.sum(-1) > 0).astype(jnp.float32)  # mean lam_policy over sequences that have decisions
  diag["lam_policy_mean"] = adv_lib.masked_mean(policy_lambda(free, hp, batch.get("row_episode")), rows)
  return values * mask, adv, ret, diag


def minibatch_rows(rows: np.ndarray, lengths: np.ndarray, images: np.ndarray, size: int,
                   rng: np.random.Generator, by_length: bool) -> list[np.ndarray]:
  """One epoch's minibatches: index arrays [size] int of `rows`, each row once (the last minibatch
  topped up with random rows of the set, so every step has one jit shape).

  lengths, images: [B] real tokens and screenshots per batch row. by_length=False: a random
  permutation cut in order (the draws of the plain PPO epoch). True: rows sorted by the jit shape
  they need (`trim_padding`'s sequence and image buckets), ties in random order, and the minibatches
  in random order, so a minibatch of one-screen episodes is not padded to the longest episode of the
  batch (verl's sequence balancing does the same for token budgets).
  """
  perm = rng.permutation(rows)
  if by_length:
    need = np.array([_trimmed_shape(lengths[r], images[r], 1 << 30, 1 << 30) for r in perm])
    perm = perm[np.lexsort((need[:, 1], need[:, 0]))] if len(perm) else perm
  out = []
  for s in range(0, len(perm), size):
    idx = perm[s:s + size]
    if len(idx) < size:
      idx = np.concatenate([idx, rng.choice(rows, size - len(idx))])
    out.append(idx)
  if by_length:
    out = [out[i] for i in rng.permutation(len(out))]
  return out


def minibatches(batch: dict, rows: np.ndarray, lengths: np.ndarray, images: np.ndarray, size: int,
                rng: np.random.Generator, by_length: bool):
  """One epoch of (row indices [size], minibatch dict cut to its content) of `batch`: the rows of
  `minibatch_rows`, the fields `trim_padding` cuts. Shared by the PPO and the value-pretraining
  updates."""
  for idx in minibatch_rows(rows, lengths, images, size, rng, by_length):
    yield idx, trim_padding({k: v[idx] for k, v in batch.items()}, lengths[idx], images[idx])


_TRIM_FLOOR = 64  # smallest sequence bucket of a trimmed minibatch (tokens)


def _trimmed_shape(length: int, images: int, t: int, m: int) -> tuple[int, int]:
  return (half_octave_bucket(int(length), _TRIM_FLOOR, max(t, _TRIM_FLOOR)) if t >= _TRIM_FLOOR else t,
          pow2_bucket(max(1, int(images)), 1, m))


def trim_padding(mb: dict, lengths: np.ndarray, images: np.ndarray) -> dict:
  """A minibatch cut to its content: tokens [b, T] -> [b, t] (t the smallest of 64 * {1, 1.5, 2, 3, 4,
  6, ...} >= its longest row, at most T: `half_octave_bucket`), target-aligned fields [b, T-1] ->
  [b, t-1], screenshots [b, M, ...] -> [b, m] (m = 2**k >= its most screenshots, at most M). Rows are
  right-padded and the model is causal, so the real tokens' log-probs and values are those of the padded
  batch (to float rounding); a few bucketed shapes keep the number of compilations small. lengths, images: [b] per row."""
  t_full, m_full = mb["tokens"].shape[1], mb["image_mask"].shape[1]
  t, m = _trimmed_shape(lengths.max(), images.max(), t_full, m_full)
  if (t, m) == (t_full, m_full):
    return mb
  out = {}
  for k, v in mb.items():
    if k in ("pixel_values", "image_mask", POLICY_FEATURES, CRITIC_FEATURES):
      out[k] = v[:, :m]
    elif getattr(v, "ndim", 0) >= 2 and v.shape[1] == t_full:
      out[k] = v[:, :t]
    elif getattr(v, "ndim", 0) >= 2 and v.shape[1] == t_full - 1:
      out[k] = v[:, :t - 1]
    else:
      out[k] = v
  return out


def ppo_update(state: dict, batch: dict[str, np.ndarray], table, *, policy_gd, critic_gd, popt, copt,
               hp: PPOHparams, inputs: ModelInputs, epochs: int, minibatch_size: int, rng: np.random.Generator,
               n_real: int, scores: np.ndarray | None = None, group_ids: np.ndarray | None = None,
               ref_params=None, minibatch_by_length: bool = False,
               ptx_batches: Iterator[dict] | None = None, task_ids: np.ndarray | None = None
               ) -> tuple[dict, dict[str, float]]:
  """Full update on one rollout batch; returns (state, mean metrics over minibatch steps, plus
  `tokens_trained`, the real tokens that went through a training step).

  Only the first `n_real` rows are real episodes; padding rows have zero masks and are never
  placed in a minibatch of their own. A batch with `row_episode` (memory: episodes cut into rows,
  `trajectory.collate`) has `n_real` episodes and trains the rows with `row_episode >= 0`;
  `scores` / `group_ids` are then per episode and each row takes its episode's advantage. `hp.algo != "ppo"` needs `scores` [n_real] (episode returns)
  and `group_ids` [n_real] (same id = same task and seed); rows with zero advantage are skipped, and
  episodes alone in their group get zero advantage (metric `groups_dropped_singleton`).
  `informative_fraction`: the share of the n_real episodes that carry signal. Group baselines: an
  episode of a group (>= 2 episodes) whose returns differ, and not itself at the group's mean (its
  advantage is 0 then; with 0/1 returns that never happens), i.e. the rows trained on. PPO: an
  episode whose mean |advantage| before whitening over its free decisions exceeds
  `rl.metrics.PPO_INFORMATIVE_EPS` (`prepare`). Per-token means (entropy, clip fractions, KL)
  are over free decisions (`free_decisions`).
  `hp.kl_coef > 0` needs `ref_params` (the reference policy's nnx.State, e.g. the initial policy).
  `task_ids` [n_real] int (same id = same task; `rollout.jobs.task_ids`): PPO's `prepare` then logs the
  between-task advantage offset, and `hp.task_baseline` (which needs them) removes it.
  `hp.ptx_coef > 0` needs `ptx_batches`, an iterator of collated demonstration batches
  (`sft.demo_batches`): one is drawn for every minibatch step (epochs x minibatches per call).
  Each minibatch is cut to its own content (`trim_padding`); `minibatch_by_length` (config
  `rl.minibatch_by_length`) groups rows of similar length into minibatches (`minibatches`).
  Raises: ValueError if a group-relative algo gets no scores/group_ids, a KL penalty no reference or
    a ptx term no demonstrations; NonFiniteError (a ValueError) naming the positions of NaN/inf in rewards,
    behaviour log-probs, critic values or scores.
  """
  check_finite(rewards=batch["rewards"], old_logp=batch["old_logp"])
  if hp.skip_typed_text:
    batch = dict(batch, **{TYPED_TEXT: typed_text.typed_text_targets(
        to_host(batch["tokens"]), to_host(batch["loss_mask"])).astype(np.float32)})
  if hp.ptx_coef > 0 and ptx_batches is None:
    raise ValueError("rl.ptx_coef > 0 needs ptx_batches (demonstration batches: config rl.ptx_data)")
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  attn = to_host(batch["attn_mask"])  # also a batch of global arrays over several processes
  lengths, images = attn.sum(-1), to_host(batch["image_mask"]).sum(-1)
  batch = trim_padding(batch, lengths, images)  # screenshot slots no episode of the batch used
  if hp.kl_coef > 0:
    if ref_params is None:
      raise ValueError("rl.kl_coef > 0 needs ref_params (the reference policy)")
    # its own encoder on the screenshots: the reference need not share the policy's frozen encoder
    batch["ref_logp"] = reference_logp(ref_params, batch, table, policy_gd=policy_gd,
                                       hp=dataclasses.replace(hp, freeze_vision=False), inputs=inputs)
  if hp.freeze_vision:  # each encoder once per rollout batch, not in every minibatch step
    px, im = batch.pop("pixel_values"), batch["image_mask"]
    batch[POLICY_FEATURES] = step_lib.image_features(policy_gd, state["policy"], px, im)
    if hp.algo == "ppo":
      batch[CRITIC_FEATURES] = step_lib.image_features(critic_gd, state["critic"], px, im)
  if hp.decoupled:  # the proximal policy: this update's starting point (one extra forward pass)
    batch["prox_logp"] = reference_logp(state["policy"], batch, table, policy_gd=policy_gd, hp=hp, inputs=inputs)
  row_ep = to_host(batch["row_episode"]) if "row_episode" in batch else None
  real = np.nonzero(row_ep >= 0)[0] if row_ep is not None else np.arange(n_real)
  if hp.algo == "ppo":
    row_task = None
    if task_ids is not None:  # each row takes its episode's task; padding rows none (-1)
      row_task = np.full((batch["tokens"].shape[0],), -1, np.int32)
      row_task[real] = np.asarray(task_ids)[row_ep[real] if row_ep is not None else real]
    values, adv, ret, diag = prepare(state["critic"], batch, table, row_task, critic_gd=critic_gd, hp=hp,
                                     inputs=inputs)
    check_finite(values=values)
    batch.update(old_values=values, advantages=adv, returns=ret)
    rows = real
    step = functools.partial(minibatch_step, policy_gd=policy_gd, critic_gd=critic_gd, popt=popt,
                             copt=copt, hp=hp, inputs=inputs)
  else:
    if scores is None or group_ids is None:
      raise ValueError(f"algo {hp.algo!r} needs episode scores and group_ids")
    check_finite(scores=scores[:n_real])
    ep_adv = outcome_advantages(scores[:n_real], group_ids[:n_real], hp.algo)
    # A group left with one episode (lost episodes) has no baseline: drop it rather than train on
    # its raw score (what grpo/rloo_advantages give a singleton, verl's convention).
    single = np.asarray(adv_lib.group_sizes(group_ids[:n_real])) < 2 if n_real else np.zeros(0, bool)
    ep_adv = np.where(single, 0.0, ep_adv).astype(np.float32)
    full = np.zeros((batch["tokens"].shape[0],), np.float32)
    if row_ep is not None:  # each row of an episode takes the episode's advantage
      full[real] = ep_adv[row_ep[real]]
      rows = real[np.abs(full[real]) > 1e-6]
      informative = int(np.count_nonzero(np.abs(ep_adv) > 1e-6))
    else:
      full[:n_real] = ep_adv
      rows = np.nonzero(np.abs(ep_adv) > 1e-6)[0]
      informative = len(rows)
    batch["advantages"] = jnp.asarray(full)[:, None] * batch["loss_mask"]
    diag = {"informative_fraction": informative / max(1, n_real), "advantage_abs_mean":
            float(np.abs(ep_adv).mean()) if n_real else 0.0,
            "groups_dropped_singleton": int(single.sum())}  # a singleton group is one episode
    step = functools.partial(policy_step, policy_gd=policy_gd, popt=popt, hp=hp, inputs=inputs)
  collected: list[dict] = []
  tokens = 0.0
  for _ in range(epochs if len(rows) else 0):
    for idx, mb in minibatches(batch, rows, lengths, images, minibatch_size, rng, minibatch_by_length):
      ptx_grads = None
      if hp.ptx_coef > 0:  # the demonstration term's gradient at the params this step starts from
        ptx_grads, ptx_m = ptx_gradients(state["policy"], next(ptx_batches), table, policy_gd=policy_gd, hp=hp,
                                         inputs=inputs)
      state, m = step(state, mb, table, ptx_grads)
      if hp.ptx_coef > 0:
        m = dict(m, **ptx_m)
      collected.append(m)
      tokens += float(attn[idx].sum())
  out = {k: float(np.mean([float(m[k]) for m in collected])) for k in collected[0]} if collected else {}
  out.update({k: float(v) for k, v in diag.items()})
  out["tokens_trained"] = tokens  # real tokens of all minibatch rows (repeats included), all epochs
  return state, out
