"""The trainer's first minibatch is on-policy: a real rollout of the smoke config (real sandbox
server, real Chromium, the trainer's `BatchedPolicy` with grammar and jump-forward decoding) goes
through `collate` and `ppo.ppo_update`, and before any update the log-probs the trainer recomputes
(`ppo.reference_logp`, the function its loss calls, i.e. `sampler.token_logprobs` over a full
forward) equal the sampler's on every model token: ratio 1 and KL 0."""

import numpy as np
import pytest

from envs_bridge.launch import env_fleet
from experiments.configs import miniwob_ppo
from tars_jax.agent.trajectory import collate
from tars_jax.rollout.agent_loop import run_episodes
from tars_jax.rollout.jobs import group_ids, rollout_jobs
from tars_jax.rl import losses
from tars_jax.train import ppo
from tars_jax.train import state as state_lib

# |logp_train - logp_sampler| on a model token. The sampler's log-probs come from a KV-cached decode
# (chunks of up to 8 tokens), the trainer's from one full forward over the padded episode: the same
# float32 math in other summation orders, a few ulps of |logits| ~ 10 (~1e-6), far below this.
TOL = 1e-5


@pytest.mark.long  # ~60 s: sandbox server + Chromium start, two compilations of the smoke policy
@pytest.mark.browser
def test_first_minibatch_of_a_real_rollout_is_on_policy():
  cfg = miniwob_ppo.get_config("smoke")
  parts = state_lib.build(cfg)
  state = parts.init_state(cfg.seed)
  n = cfg.env.num_sessions
  policy = parts.batched_policy(state["policy"], batch_size=n, seed=cfg.seed)
  policy.start_iteration(0)
  with env_fleet(cfg.env) as (loop, clients):
    jobs = rollout_jobs(tuple(cfg.tasks), n, cfg.rl.group_size, 0, cfg.env.train_seed_offset)
    episodes = loop.run_until_complete(run_episodes(policy.act, clients, jobs, parts.loop_cfg, parts.tokenizer))
  assert not any(e.lost for e in episodes)
  batch = collate(episodes, pad_id=parts.tokenizer.pad_id, max_images=cfg.env.max_turns, image_hw=parts.image_hw,
                  length_multiple=cfg.length_multiple, batch_size=n).as_dict()
  mask = batch["loss_mask"] > 0
  # precondition: real episodes with sampled (not only grammar-forced) tokens on several turns
  assert sum(len(e.turns) for e in episodes) >= n and (batch["old_logp"][mask] < -1e-3).sum() >= n

  # Every model token, all rows (the smoke config's first minibatch is the whole batch).
  logp = np.asarray(ppo.reference_logp(state["policy"], batch, parts.table, policy_gd=parts.policy_gd,
                                       hp=parts.hparams, inputs=parts.inputs))
  d = logp[mask] - batch["old_logp"][mask]
  assert np.abs(d).max() <= TOL, f"max |logp - old_logp| = {np.abs(d).max():.3g}"
  np.testing.assert_allclose(np.exp(d), 1.0, atol=TOL)  # ratio
  np.testing.assert_allclose(np.asarray(losses.kl_penalty(logp[mask], batch["old_logp"][mask], "k3")), 0.0,
                             atol=TOL)

  # Padding changes no log-prob: the same episodes collated to 512 tokens and twice the screenshot
  # slots, as given and as `ppo.trim_padding` cuts them for a minibatch, against the sampler's.
  wide = collate(episodes, pad_id=parts.tokenizer.pad_id, max_images=2 * cfg.env.max_turns,
                 image_hw=parts.image_hw, length_multiple=512, batch_size=n).as_dict()
  cut = ppo.trim_padding(wide, wide["attn_mask"].sum(-1), wide["image_mask"].sum(-1))
  assert cut["tokens"].shape[1] < 512 and cut["pixel_values"].shape[1] < 2 * cfg.env.max_turns
  t = batch["tokens"].shape[1] - 1
  for b in (wide, cut):
    lp = np.asarray(ppo.reference_logp(state["policy"], b, parts.table, policy_gd=parts.policy_gd,
                                       hp=parts.hparams, inputs=parts.inputs))
    assert np.abs(lp[:, :t][mask] - batch["old_logp"][mask]).max() <= TOL

  # The trainer's own first minibatch step reports the same (its metrics are of that minibatch:
  # one epoch, one minibatch of all n rows).
  assert cfg.rl.minibatch_size == n
  _, m = ppo.ppo_update(state, batch, parts.table, policy_gd=parts.policy_gd, critic_gd=parts.critic_gd,
                        popt=parts.popt, copt=parts.copt, hp=parts.hparams, inputs=parts.inputs, epochs=1, minibatch_size=n,
                        rng=np.random.default_rng(0), n_real=len(episodes),
                        scores=np.array([e.shaped_return for e in episodes], np.float32),
                        group_ids=group_ids(episodes))
  assert abs(m["ratio_mean"] - 1.0) <= TOL and abs(m["approx_kl"]) <= TOL and m["approx_kl_k3"] <= TOL
  assert m["clipfrac"] == 0.0
