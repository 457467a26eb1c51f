"""Everything a trainer or evaluator builds from a config: tokenizer, grammar, models, optimisers.

`build(config)` returns `Parts`; `Parts.init_state(seed)` makes the train state pytree
`{"step", "policy", "critic", "policy_opt", "critic_opt"}` (nnx.State + optax states) that the PPO
update transforms and Orbax saves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.agent import prompts
from tars_jax.agent.grammar import Grammar, build_grammar
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.models import ModelConfig, Policy, ValueModel
from tars_jax.rl.rewards import RewardConfig
from tars_jax.rollout.agent_loop import LoopConfig
from tars_jax.rollout.inference_server import BatchedPolicy, max_reply_tokens
from tars_jax.train import ppo


@dataclasses.dataclass
class Parts:
  config: Any
  tokenizer: ByteTokenizer
  model_cfg: ModelConfig
  grammar: Grammar | None
  table: Any  # jnp [S, V] int32 or None
  policy_gd: Any
  critic_gd: Any
  popt: Any
  copt: Any
  hparams: ppo.PPOHparams
  loop_cfg: LoopConfig
  image_hw: tuple[int, int]
  max_new_tokens: int

  def init_state(self, seed: int) -> dict:
    """Fresh train state (random init of policy and critic) from `seed`."""
    kp, kc = jax.random.split(jax.random.PRNGKey(seed))
    policy = Policy(self.model_cfg, rngs=nnx.Rngs(kp))
    critic = ValueModel(self.model_cfg, rngs=nnx.Rngs(kc))
    _, pp = nnx.split(policy)
    _, cp = nnx.split(critic)
    return {"step": jnp.zeros((), jnp.int32), "policy": pp, "critic": cp,
            "policy_opt": self.popt.init(pp), "critic_opt": self.copt.init(cp)}

  def batched_policy(self, params, batch_size: int, seed: int) -> BatchedPolicy:
    c = self.config
    return BatchedPolicy(graphdef=self.policy_gd, params=params, tokenizer=self.tokenizer,
                         grammar=self.grammar, batch_size=batch_size, max_images=c.env.max_turns,
                         image_hw=self.image_hw, max_new_tokens=self.max_new_tokens,
                         temperature=c.sampling.temperature, top_p=c.sampling.top_p,
                         jump_forward=c.sampling.get("jump_forward", 1),
                         length_multiple=c.length_multiple, seed=seed)


def build(config) -> Parts:
  """Builds the static parts of a run from its ConfigDict (no parameters are created)."""
  tok = ByteTokenizer()
  mcfg = ModelConfig.from_dict({**config.model.to_dict(), "vocab_size": tok.vocab_size})
  g = config.grammar
  grammar = None
  if g.constrained:
    grammar = build_grammar(tok, actions=tuple(g.actions), max_thought_bytes=g.max_thought_bytes,
                            max_content_bytes=g.max_content_bytes, coord_format=g.coord_format)
  # Graph definitions only: abstract init, no parameter memory.
  policy_gd, _ = nnx.split(nnx.eval_shape(lambda: Policy(mcfg, rngs=nnx.Rngs(0))))
  critic_gd, _ = nnx.split(nnx.eval_shape(lambda: ValueModel(mcfg, rngs=nnx.Rngs(0))))
  r = config.rl
  popt = ppo.make_optimizer(r.lr, r.warmup_steps, r.max_grad_norm, r.weight_decay)
  copt = ppo.make_optimizer(r.critic_lr, r.warmup_steps, r.max_grad_norm, r.weight_decay)
  image_hw = (config.model.image_h, config.model.image_w)
  grid_hw = mcfg.merged_grid
  if r.algo not in ppo.ALGOS:
    raise ValueError(f"unknown rl.algo {r.algo!r}; expected one of {ppo.ALGOS}")
  hp = ppo.PPOHparams(algo=r.algo, gamma=r.gamma, lam_policy=r.lam_policy, lam_critic=r.lam_critic,
                      whiten_advantages=r.whiten_advantages, clip_low=r.clip_low, clip_high=r.clip_high,
                      clip_c=r.clip_c, value_clip=r.value_clip, vf_coef=r.vf_coef, ent_coef=r.ent_coef,
                      aux_loss_coef=r.aux_loss_coef, loss_agg=r.loss_agg,
                      temperature=config.sampling.temperature, image_token_id=tok.image_id,
                      grid_hw=tuple(grid_hw))
  actions = tuple(g.actions) if g.constrained else None
  loop_cfg = LoopConfig(max_turns=config.env.max_turns, image_hw=image_hw,
                        n_img_tokens=grid_hw[0] * grid_hw[1],
                        system=prompts.system_prompt(actions, compact=True),
                        rewards=RewardConfig(r.outcome_weight, r.format_penalty, r.truncation_reward))
  max_new = max_reply_tokens(grammar) if grammar is not None else 64
  table = None if grammar is None else jnp.asarray(grammar.table)
  return Parts(config, tok, mcfg, grammar, table, policy_gd, critic_gd, popt, copt, hp, loop_cfg,
               image_hw, max_new)
