"""Everything a trainer or evaluator builds from a config: tokenizer, grammar, models, optimisers.

`build(config)` returns `Parts`; `Parts.init_state(seed)` makes the train state pytree
`{"step", "policy", "critic", "policy_opt", "critic_opt"}` (nnx.State + optax states) that the PPO
update transforms and Orbax saves. With `config.mesh.shape` set (data, fsdp, tensor, expert), the
state is created directly in the sharded layout the logical-axis rules (`config.mesh.rules`
overriding `sharding.DEFAULT_RULES`) give; without it (the default) nothing changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tars_jax import sharding
from tars_jax.agent import prompts
from tars_jax.agent import hf_tokenizer
from tars_jax.agent.grammar import Grammar, build_grammar, free_grammar
from tars_jax.agent.memory import MemoryConfig
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.models import ModelConfig, Policy, ValueModel
from tars_jax.rl.rewards import RewardConfig
from tars_jax.rollout.episode import LoopConfig
from tars_jax.rollout.inference_server import BatchedPolicy, InferenceService, max_reply_tokens
from tars_jax.train import checkpoint, ppo
from tars_jax.train.step import ModelInputs


@dataclasses.dataclass
class Parts:
  config: Any
  tokenizer: ByteTokenizer
  model_cfg: ModelConfig
  grammar: Grammar  # the action grammar, or `free_grammar` when config.grammar.constrained is False
  table: Any  # jnp [S, V] int32: grammar.table
  policy_gd: Any
  critic_gd: Any
  popt: Any
  copt: Any
  hparams: ppo.PPOHparams
  inputs: ModelInputs  # how a batch's tokens become the model's inputs (IMAGE id, screenshot grid)
  loop_cfg: LoopConfig
  eval_loop_cfg: LoopConfig  # loop_cfg with the held-out evaluation's `env.eval_data_mode`
  image_hw: tuple[int, int]
  max_new_tokens: int
  mesh: Any = None  # jax Mesh of config.mesh.shape, or None (one device)
  rules: Any = None  # logical-axis rules (sharding.make_rules) used with `mesh`
  hf: Any = None  # hf_tokenizer.HFAgent of `policy.init=hf:<dir>` (its weights are the initial policy), or None

  def init_state(self, seed: int) -> dict:
    """Fresh train state (random init of policy and critic) from `seed`, every leaf committed
    (`sharding.committed`: the first update compiles its step once, not twice).

    With a mesh: parameters initialised straight into their shards (`sharding.sharded_init`) and
    optimiser states created with the same shardings (Adam moments like their parameters);
    the values are those of a jitted init (not bit-equal to the eager one-device init).
    """
    kp, kc = jax.random.split(jax.random.PRNGKey(seed))
    if self.hf is not None:
      return sharding.committed(self._init_from_hf(kc))
    if self.mesh is not None:
      return sharding.committed(self._init_sharded(kp, kc))
    return sharding.committed(self._init_one_device(kp, kc))

  def _init_one_device(self, kp, kc) -> dict:
    policy = Policy(self.model_cfg, rngs=nnx.Rngs(kp))
    critic = ValueModel(self.model_cfg, rngs=nnx.Rngs(kc))
    _, pp = nnx.split(policy)
    _, cp = nnx.split(critic)
    return {"step": jnp.zeros((), jnp.int32), "policy": pp, "critic": cp,
            "policy_opt": self.popt.init(pp), "critic_opt": self.copt.init(cp)}

  def _init_sharded(self, kp, kc) -> dict:
    _, pp = sharding.sharded_init(lambda: Policy(self.model_cfg, rngs=nnx.Rngs(kp)), self.mesh, self.rules)
    _, cp = sharding.sharded_init(lambda: ValueModel(self.model_cfg, rngs=nnx.Rngs(kc)), self.mesh, self.rules)

    def opt_init(opt, params):
      target = sharding.logical_to_sharding(jax.eval_shape(opt.init, params), self.mesh, self.rules)
      return jax.jit(opt.init, out_shardings=target)(params)

    step = jax.device_put(jnp.zeros((), jnp.int32), jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
    return {"step": step, "policy": pp, "critic": cp, "policy_opt": opt_init(self.popt, pp),
            "critic_opt": opt_init(self.copt, cp)}

  def _init_from_hf(self, kc) -> dict:
    """`policy.init=hf:<dir>`: the policy is the checkpoint (`hf_io.load_pretrained`, placed by the
    mesh's rules when there is one); the critic's trunk starts as a copy of the checkpoint's trunk
    and its value head at zero (`ValueModel`)."""
    from tars_jax.models.interop import hf_io
    overrides = dict(self.hf.load_overrides)
    compute = overrides.pop("dtype", "float32")  # float32 parameters; config.model.dtype computes
    model = hf_io.load_pretrained(self.hf.path, mesh=self.mesh, rules=self.rules, **overrides)
    if compute != model.cfg.dtype:
      model = model.with_compute_dtype(compute)
    _, pp = nnx.split(model.policy)
    del model
    if self.mesh is not None:
      _, cp = sharding.sharded_init(lambda: ValueModel(self.model_cfg, rngs=nnx.Rngs(kc)), self.mesh, self.rules)
    else:
      _, cp = nnx.split(ValueModel(self.model_cfg, rngs=nnx.Rngs(kc)))
    trunk = {tuple(p): v for p, v in nnx.to_flat_state(pp) if p[0] == "trunk"}
    flat = nnx.to_flat_state(cp)
    for p, var in flat:
      if tuple(p) in trunk:
        var.value = jnp.copy(trunk[tuple(p)].value)
    cp = nnx.from_flat_state(flat)
    step = jnp.zeros((), jnp.int32)
    if self.mesh is not None:
      step = jax.device_put(step, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
    return {"step": step, "policy": pp, "critic": cp, "policy_opt": self.popt.init(pp),
            "critic_opt": self.copt.init(cp)}

  def served_model_id(self) -> str:
    """16 hex digits naming what a policy service and its clients must agree on: the architecture
    (`model_cfg` without hf_tokenizer.RUNTIME_FIELDS: dtype, kernels), the tokenizer and its vocabulary,
    the action grammar's table, the screenshot size, the system prompt and the sampling distribution
    (temperature, top-p: the behaviour policy PPO's ratio divides by). A trainer refuses an inference
    service whose id differs (`inference_remote.RemoteInference(expect_model=...)`)."""
    m = {k: v for k, v in self.model_cfg.to_dict().items() if k not in hf_tokenizer.RUNTIME_FIELDS}
    s = self.config.sampling
    h = hashlib.sha256(json.dumps({"model": m, "tokenizer": type(self.tokenizer).__name__,
                                   "vocab": self.tokenizer.vocab_size, "image_hw": list(self.image_hw),
                                   "system": self.loop_cfg.system, "temperature": float(s.temperature),
                                   "top_p": float(s.top_p)}, sort_keys=True, default=str).encode())
    h.update(np.ascontiguousarray(np.asarray(self.grammar.table)).tobytes())
    return h.hexdigest()[:16]

  def inference_service(self, params, slots: int, seed: int, version: int = 0,
                        max_turns: int | None = None) -> InferenceService:
    """The continuous-batching service of streaming rollouts (`rollout.streaming`), serving `params`
    as `version`. Its cache holds `rollout.context_len` positions per slot (0: `context_capacity`);
    `max_turns` (default `env.max_turns`): the longest episode it serves, in turns (screenshots)."""
    c = self.config
    turns = max_turns or c.env.max_turns
    return InferenceService(self.policy_gd, params, tokenizer=self.tokenizer, grammar=self.grammar, slots=slots,
                            context_len=c.rollout.context_len or self.context_capacity(turns), max_images=turns,
                            image_hw=self.image_hw, max_new_tokens=self.max_new_tokens,
                            temperature=c.sampling.temperature, top_p=c.sampling.top_p,
                            jump_forward=c.sampling.jump_forward, length_multiple=c.length_multiple,
                            seed=seed, version=version, quantize=c.sampling.quantize)

  def context_capacity(self, max_turns: int | None = None) -> int:
    """Cache positions (tokens) one streaming request may need: the system prompt, 1 KiB of
    instruction bytes, per turn an observation (image tokens and 256 bytes of observation text) and a
    reply, plus one decode chunk, for `max_turns` turns (default `env.max_turns`); rounded up to
    `length_multiple`. A longer prompt is refused with
    `inference_server.ContextTooLong` (set `rollout.context_len`)."""
    c = self.config
    per_turn = self.loop_cfg.n_img_tokens + 256 + self.max_new_tokens + 8
    n = len(self.loop_cfg.system.encode()) + 1024 + (max_turns or c.env.max_turns) * per_turn + self.max_new_tokens
    m = c.length_multiple
    return -(-(n + c.sampling.jump_forward + m) // m) * m

  def activate(self):
    """Context in which jitted train/rollout functions are traced with the activation sharding
    constraints of `mesh` (a no-op context without a mesh)."""
    return sharding.activate(self.mesh, self.rules)

  def remote_client(self, url: str | None = None):
    """A client (`inference_remote.RemoteInference`) of the `experiments/serve.py` service at `url`
    (default `rollout.inference`), checked to serve this model (`served_model_id`), waiting at most
    `rollout.inference_timeout_s` per call. Close it when done. Raises: InferenceUnavailable,
    ModelMismatch."""
    from tars_jax.rollout.inference_remote import RemoteInference  # httpx / FastAPI only when asked for
    c = self.config
    # .get: the config.json of a run made before the field (eval reads it); 120 s = miniwob_ppo.py's
    return RemoteInference(url or c.rollout.inference, timeout_s=c.rollout.get("inference_timeout_s", 120.0),
                           expect_model=self.served_model_id())

  def remote_policy(self, params, version: int, url: str | None = None):
    """`remote_client(url)` with `params` pushed as weights `version` (reset: the service may hold a
    later version): one process's policy on the service. Its sampling keys are the service's own, so
    episodes do not replay from the seed. Raises: as `remote_client`."""
    remote = self.remote_client(url)
    try:
      remote.set_params(params, version, reset=True)
    except BaseException:
      remote.close()
      raise
    return remote

  def batched_policy(self, params, batch_size: int, seed: int) -> BatchedPolicy:
    c = self.config
    return BatchedPolicy(graphdef=self.policy_gd, params=params, tokenizer=self.tokenizer,
                         grammar=self.grammar, batch_size=batch_size, max_images=c.env.max_turns,
                         image_hw=self.image_hw, max_new_tokens=self.max_new_tokens,
                         temperature=c.sampling.temperature, top_p=c.sampling.top_p,
                         jump_forward=c.sampling.jump_forward,
                         length_multiple=c.length_multiple, seed=seed, quantize=c.sampling.quantize)


def load_critic(state: dict, path: str, copt) -> dict:
  """`state` with its critic restored from a `checkpoint.save_tree` directory (value pretraining)
  and a fresh critic optimiser state (committed, `sharding.committed`).
  Raises: FileNotFoundError / ValueError (mismatched model)."""
  critic = checkpoint.restore_tree(path, state["critic"])
  return dict(state, critic=critic, critic_opt=sharding.committed(copt.init(critic)))


def checkpoint_location(path: str) -> tuple[str, int | None]:
  """(run dir, step) of a checkpoint named by a run dir (step None: its latest) or by one of its step
  dirs `<run>/checkpoints/<step>`; the run dir absolute. Reads no file (shared with `tars_jax.merge`)."""
  path = os.path.abspath(path)
  parent, name = os.path.split(path)
  if name.isdigit() and os.path.basename(parent) == "checkpoints":
    return os.path.dirname(parent), int(name)
  return path, None


def restore_run_state(state: Any, path: str) -> tuple[dict, int, str]:
  """A run's checkpointed train state: (state dict, checkpoint step, "<checkpoint dir>/<step>").

  state: the train state of the run's model config (or its `jax.eval_shape`): the checkpoint is
    restored into its structure and shardings.
  path: a run dir (its latest complete checkpoint) or one of its step dirs `<run>/checkpoints/<step>`.
  Raises: FileNotFoundError (no such run / checkpoint); ValueError (from Orbax) for another model.
  """
  run, step = checkpoint_location(path)
  if not os.path.isdir(os.path.join(run, "checkpoints")):
    raise FileNotFoundError(f"{path!r}: no run dir with checkpoints/ (nor a <run>/checkpoints/<step>)")
  mngr = checkpoint.manager(run)
  step, restored, _ = checkpoint.restore(mngr, state, step)
  mngr.close()
  return restored, step, f"{mngr.directory}/{step}"


def restore_policy(state: Any, path: str) -> tuple[Any, int, str]:
  """The policy of a run's checkpoint: (policy nnx.State, checkpoint step, "<checkpoint dir>/<step>").
  The one "load a run's policy" of evaluation, export, merge evaluation, the ORM scorer, the remote
  inference service and `load_policy` (a trainer's `policy.init`). Arguments and errors: `restore_run_state`.
  """
  restored, step, src = restore_run_state(state, path)
  return restored["policy"], step, src


def load_policy(state: dict, path: str, popt) -> tuple[dict, str]:
  """`state` with its policy restored from another run (e.g. the SFT stage) and a fresh policy
  optimiser state (committed, `sharding.committed`); returns (state, "<checkpoint dir>/<step>") for the log.

  path: a run dir (its latest complete checkpoint) or one of its step dirs `<run>/checkpoints/<step>`.
  The run must have the same model config (its train state is restored into the structure of `state`).
  Raises: FileNotFoundError (no such run / checkpoint); ValueError (from Orbax) for another model.
  """
  if hf_tokenizer.hf_dir(path) is not None:  # `hf:<dir>`: Parts.init_state already holds its weights
    return state, f"{path} (transformers checkpoint, loaded by Parts.init_state)"
  try:
    policy, _, src = restore_policy(state, path)
  except FileNotFoundError as e:  # name the setting that pointed there
    raise FileNotFoundError(f"policy.init: {e}") from None
  return dict(state, policy=policy, policy_opt=sharding.committed(popt.init(policy))), src


def start_policy(state: dict, init: str, popt) -> tuple[dict, str | None]:
  """A trainer's starting state: `load_policy(state, init, popt)` when `init` (config `policy.init`)
  is set, else `state`'s own policy with a fresh committed optimiser state of `popt` (the trainer's
  optimiser may differ from `Parts.popt`); returns (state, the loaded checkpoint's name or None).
  Raises: as `load_policy`."""
  if init:
    return load_policy(state, init, popt)
  return dict(state, policy_opt=sharding.committed(popt.init(state["policy"]))), None


def hparams(config) -> ppo.PPOHparams:
  """`PPOHparams` from `config.rl` and `config.sampling.temperature`; every field must be set.

  `rl.value_clip <= 0` disables value clipping; `rl.clip_c` / `rl.length_adaptive_alpha` unset (None)
  disable dual-clip / length-adaptive lambda.
  Raises: AttributeError naming a missing config field; ValueError for unknown names or out-of-range
    values (see PPOHparams), and for `rl.group_size < 2` with a group-relative `rl.algo` (a group
    of one has no baseline: its advantage would be the raw return, i.e. REINFORCE).
  """
  r = config.rl
  if r.algo in ppo.ALGOS and r.algo != "ppo" and r.group_size < 2:
    raise ValueError(f"rl.group_size must be >= 2 for rl.algo={r.algo!r} (group-relative advantages), "
                     f"got {r.group_size}")
  vclip = r.value_clip if r.value_clip is not None and r.value_clip > 0 else None
  return ppo.PPOHparams(algo=r.algo, gamma=r.gamma, lam_policy=r.lam_policy, lam_critic=r.lam_critic,
                        length_adaptive_alpha=r.length_adaptive_alpha,
                        whiten_advantages=r.whiten_advantages, clip_low=r.clip_low, clip_high=r.clip_high,
                        clip_c=r.clip_c, value_clip=vclip, vf_coef=r.vf_coef, ent_coef=r.ent_coef,
                        aux_loss_coef=r.aux_loss_coef, loss_agg=r.loss_agg, kl_kind=r.kl_kind,
                        kl_coef=r.kl_coef, decoupled=r.decoupled,
                        behaviour_weight_cap=r.get("behaviour_weight_cap"),  # absent from older runs' configs
                        top_entropy_frac=r.get("top_entropy_frac", 1.0),  # likewise
                        ptx_coef=r.get("ptx_coef", 0.0),  # likewise
                        freeze_vision=r.get("freeze_vision", False),  # likewise
                        temperature=config.sampling.temperature,
                        skip_typed_text=r.get("skip_typed_text", False),  # likewise
                        task_baseline=r.get("task_baseline", False))  # likewise


def reward_config(r) -> RewardConfig:
  """`RewardConfig` from `config.rl`; every field must be set (AttributeError names a missing one),
  except `outcome` ("raw" when absent: the config of a run made before the field)."""
  # config.json of runs made before `rl.outcome` existed: they trained on the raw reward
  return RewardConfig(outcome=r.get("outcome", "raw"), outcome_weight=r.outcome_weight, format_penalty=r.format_penalty,
                      truncation_reward=r.truncation_reward, step_penalty=r.step_penalty,
                      overlong_weight=r.overlong_weight, overlong_max_tokens=r.overlong_max_tokens,
                      overlong_buffer=r.overlong_buffer)


def memory_config(m) -> MemoryConfig:
  """`MemoryConfig` from `config.memory`; every field must be set (AttributeError names a missing
  one; ValueError for bad values, see MemoryConfig)."""
  return MemoryConfig(working_turns=m.working_turns, max_context_tokens=m.max_context_tokens,
                      reserve_tokens=m.reserve_tokens, episodic=m.episodic,
                      episodic_episodes=m.episodic_episodes, episodic_max_tokens=m.episodic_max_tokens,
                      summary_max_tokens=m.summary_max_tokens)


def build(config) -> Parts:
  """Builds the static parts of a run from its ConfigDict (no parameters are created).

  `policy.init=hf:<dir>` (a transformers qwen2_5_vl / qwen3_vl_moe checkpoint, agent/hf_tokenizer.py):
  the checkpoint's tokenizer, chat template, image size and architecture replace the byte tokenizer
  and config.model (whose RUNTIME_FIELDS, dtype / moe_impl / ..., still apply), the system prompt is
  the full UI-TARS one with 0-1000 coordinates, and decoding is unconstrained (BPE text tokens, then
  EOS; `hf_tokenizer.free_grammar`): the format penalty does the grammar's work.
  Raises: ValueError for grammar.constrained=True or rl.skip_typed_text with an hf: init; hf_tokenizer.HFCheckpointError /
    FileNotFoundError naming what the checkpoint lacks.
  """
  g = config.grammar
  hf_path = hf_tokenizer.hf_dir(config.policy.get("init", ""))
  hf = None
  if hf_path is None:  # the byte-level model trained from scratch (the default)
    tok = ByteTokenizer()
    mcfg = ModelConfig.from_dict({**config.model.to_dict(), "vocab_size": tok.vocab_size})
  else:
    if g.constrained:
      raise ValueError(f"policy.init={config.policy.init!r}: grammar-constrained decoding is byte-level only; "
                       "set --config.grammar.constrained=False (the format penalty rl.format_penalty does its "
                       "work over a BPE vocabulary; README, 'RL from a pretrained checkpoint')")
    m = config.model.to_dict()
    hf = hf_tokenizer.load_hf_agent(hf_path, (config.model.image_h, config.model.image_w),
                                    {k: m[k] for k in hf_tokenizer.RUNTIME_FIELDS if k in m})
    tok, mcfg = hf.tokenizer, hf.model_cfg
  if hf is not None:
    grammar = hf_tokenizer.free_grammar(tok)
  elif g.constrained:
    grammar = build_grammar(tok, actions=tuple(g.actions), max_thought_bytes=g.max_thought_bytes,
                            max_content_bytes=g.max_content_bytes, coord_format=g.coord_format)
  else:  # free text, but never an image placeholder or other special id (`free_grammar`)
    grammar = free_grammar(tok)
  mesh_cfg = config.mesh  # shape () = one device
  mesh = sharding.mesh_from_config(mesh_cfg)
  rules = sharding.rules_from_config(mesh_cfg) if mesh is not None else None
  # Graph definitions only: abstract init, no parameter memory; built under the run's mesh, which
  # (with the backend) fixes the MoE strategy (`moe.select_strategy`).
  with sharding.activate(mesh, rules):
    policy_gd, _ = nnx.split(nnx.eval_shape(lambda: Policy(mcfg, rngs=nnx.Rngs(0))))
    critic_gd, _ = nnx.split(nnx.eval_shape(lambda: ValueModel(mcfg, rngs=nnx.Rngs(0))))
  r = config.rl
  popt = ppo.make_optimizer(r.lr, r.warmup_steps, r.max_grad_norm, r.weight_decay)
  copt = ppo.make_optimizer(r.critic_lr, r.warmup_steps, r.max_grad_norm, r.weight_decay)
  image_hw = (config.model.image_h, config.model.image_w) if hf is None else hf.image_hw
  grid_hw = mcfg.merged_grid
  hp = hparams(config)
  if hp.skip_typed_text and hf is not None:
    raise ValueError(f"rl.skip_typed_text finds the typed characters as bytes (rl/typed_text.py): the byte "
                     f"tokenizer only, not policy.init={config.policy.init!r}")
  inputs = ModelInputs(tok.image_id, tuple(grid_hw))
  actions = tuple(g.actions) if g.constrained else None
  loop_cfg = LoopConfig(max_turns=config.env.max_turns, image_hw=image_hw,
                        n_img_tokens=grid_hw[0] * grid_hw[1],
                        system=(prompts.system_prompt(actions, compact=True) if hf is None
                                else prompts.system_prompt(tuple(g.actions), compact=False, coord_format="int")),
                        rewards=reward_config(r), memory=memory_config(config.memory))
  max_new = max_reply_tokens(grammar) if g.constrained else 64
  table = jnp.asarray(grammar.table)
  eval_loop_cfg = dataclasses.replace(loop_cfg, data_mode=config.env.get("eval_data_mode", "train"))
  return Parts(config, tok, mcfg, grammar, table, policy_gd, critic_gd, popt, copt, hp, inputs, loop_cfg,
               eval_loop_cfg, image_hw, max_new, mesh, rules, hf)
