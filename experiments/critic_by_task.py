r"""What a critic predicts per task, on a run's recorded rollouts (tars_jax/analysis/critic_by_task.py):

  python -m experiments.critic_by_task --run runs/mt/ppo_lr1e4/seed_1 --critic runs/mt/vpt/seed_1/critic \
      --iterations 1-5                       # the value-pretrained critic on RL's first 5 iterations
  python -m experiments.critic_by_task --run runs/mt/ppo_lr1e4/seed_1 --critic runs/mt/ppo_lr1e4/seed_1 \
      --iterations 26-30                     # the run's own critic at its last checkpoint
  python -m experiments.critic_by_task --run runs/mt/ppo_lr1e4/seed_1 --critic runs/mt/vpt/seed_1/critic \
      --iterations 11-15 --fit 1-10 --passes 3   # trained further on iterations 1-10, value pretraining's step

Prints, per task of the chosen iterations' episodes: episodes, success rate, the critic's mean (and std)
value at the first decision; then corr(V(first decision), success) over the episodes and the share of the
success variance that the tasks' success rates explain (what a critic knowing only the task would reach).
With --fit, the critic is trained on the --fit iterations' episodes (`value_pretrain.value_update`: the
value-pretraining stage's own update, lambda 1, no value clip, the run's `vpt` optimiser settings unless
--lr / --epochs say otherwise) for --passes passes, and the table is printed again after each pass: how
many critic steps its values need to tell the tasks apart.

--critic: a value-pretraining critic (`<vpt run>/critic`) or a PPO run dir (its latest checkpoint's
critic) or one of its step dirs `<run>/checkpoints/<step>`. The model config is the --run's.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from absl import app, flags

from tars_jax.agent.trajectory import collate
from tars_jax.analysis import critic_by_task as cbt
from tars_jax.analysis.run_data import rollout_episodes
from tars_jax.train import ppo
from tars_jax.train import state as state_lib
from tars_jax.train import value_pretrain as vpt

_RUN = flags.DEFINE_string("run", None, "RL run dir with config.json and rollouts/.", required=True)
_CRITIC = flags.DEFINE_string("critic", None, "Critic: <vpt run>/critic, a PPO run dir or <run>/checkpoints/<step>.",
                              required=True)
_ITERS = flags.DEFINE_string("iterations", "1-5", "Rollout iterations (1-based, inclusive range 'a-b') to read.")
_FIT = flags.DEFINE_string("fit", "", "Iterations ('a-b') to train the critic on first; '' = no training.")
_PASSES = flags.DEFINE_integer("passes", 1, "Passes over the --fit iterations (the table after each).")
_EPOCHS = flags.DEFINE_integer("epochs", 0, "Epochs per --fit batch; 0 = the run's vpt.epochs.")
_LR = flags.DEFINE_float("lr", 0.0, "Critic learning rate of --fit; 0 = the run's vpt.lr.")
_BATCH = 32  # episodes per forward (one rollout iteration of the suite)


def iteration_range(text: str) -> range:
  """'a-b' -> range(a, b + 1) (1-based iterations); 'a' -> range(a, a + 1). Raises app.UsageError."""
  try:
    a, _, b = text.partition("-")
    lo, hi = int(a), int(b or a)
  except ValueError:
    raise app.UsageError(f"an iteration range is 'a-b' or 'a', got {text!r}") from None
  if not 1 <= lo <= hi:
    raise app.UsageError(f"an iteration range needs 1 <= a <= b, got {text!r}")
  return range(lo, hi + 1)


def load_critic(parts, config, path: str):
  """The critic parameters at `path` (see --critic), in the run's model structure."""
  state = parts.init_state(config.seed)
  if os.path.isdir(os.path.join(state_lib.checkpoint_location(path)[0], "checkpoints")):  # a run or its step dir
    restored, _, src = state_lib.restore_run_state(state, path)
    print(f"critic: {src}")
    return restored["critic"]
  print(f"critic: {path}")
  return state_lib.load_critic(state, path, parts.copt)["critic"]


def main(argv):
  del argv
  with open(os.path.join(_RUN.value, "config.json")) as f:
    config = mlc.ConfigDict(json.load(f))
  parts = state_lib.build(config)
  by_iter: dict[int, list] = {}
  for it, ep in rollout_episodes(os.path.join(_RUN.value, "rollouts")):
    by_iter.setdefault(it, []).append(ep)
  read, fit = iteration_range(_ITERS.value), iteration_range(_FIT.value) if _FIT.value else range(0)
  missing = [i for i in (*read, *fit) if i not in by_iter]
  if missing:
    raise app.UsageError(f"{_RUN.value}/rollouts has no episodes of iterations {missing} (it has "
                         f"{min(by_iter)}-{max(by_iter)})")

  def batch_of(eps):
    return collate(eps, pad_id=parts.tokenizer.pad_id, max_images=config.env.max_turns, image_hw=parts.image_hw,
                   length_multiple=config.length_multiple).as_dict()

  def table(critic, title: str) -> None:
    tasks, first, success = [], [], []
    for i in read:
      eps = by_iter[i]
      for s in range(0, len(eps), _BATCH):
        chunk = eps[s:s + _BATCH]
        b = batch_of(chunk)
        values, _, _, _ = ppo.prepare(critic, {k: jnp.asarray(v) for k, v in b.items()}, critic_gd=parts.critic_gd,
                                      hp=hp, inputs=parts.inputs)  # jitted; values zeroed off the loss mask
        first.extend(cbt.first_decision_values(np.asarray(values), b["loss_mask"]))
        tasks += [ep.task for ep in chunk]
        success += [bool(ep.success) for ep in chunk]
    rows = cbt.by_task(tasks, np.asarray(first), success)
    print(f"\n{title}: iterations {read.start}-{read.stop - 1} of {_RUN.value}\n")
    print("| task | episodes | success | V(first decision) mean (std) |")
    print("|---|---|---|---|")
    for r in rows:
      print(f"| {r.task} | {r.episodes} | {r.success:.3f} | {r.value:.3f} ({r.value_std:.3f}) |")
    corr = np.corrcoef(first, success)[0, 1] if np.std(first) > 0 and np.std(success) > 0 else 0.0
    print(f"\ncorr(V(first decision), success) over {len(success)} episodes {corr:.3f}; share of the success "
          f"variance the tasks' success rates explain {cbt.between_task_share(rows):.3f}")

  hp = vpt.pretrain_hparams(parts.hparams, None)  # lambda 1, the critic's encoder its own (no frozen features)
  critic = load_critic(parts, config, _CRITIC.value)
  table(critic, "critic as loaded")
  if not fit:
    return
  v, r = config.vpt, config.rl
  lr, epochs = _LR.value or v.lr, _EPOCHS.value or v.epochs
  copt = ppo.make_optimizer(lr, r.warmup_steps, r.max_grad_norm, r.weight_decay)
  state = vpt.init_critic_state(critic, copt)
  rng = np.random.default_rng(config.seed)
  for p in range(_PASSES.value):
    for i in fit:
      state, _ = vpt.value_update(state, batch_of(by_iter[i]), critic_gd=parts.critic_gd, copt=copt, hp=hp,
                                  inputs=parts.inputs, epochs=epochs, minibatch_size=v.minibatch_size, rng=rng,
                                  n_real=len(by_iter[i]), minibatch_by_length=r.minibatch_by_length)
    table(state["critic"], f"after pass {p + 1} over iterations {fit.start}-{fit.stop - 1} "
                           f"({int(state['step'])} critic steps, lr {lr:g}, {epochs} epochs per batch)")


if __name__ == "__main__":
  app.run(main)
