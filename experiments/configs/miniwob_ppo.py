r"""RL from random init on MiniWoB++ click tasks, from pixels, in a Playwright sandbox over HTTP.

The main job of README.md (issue #2): a tiny Qwen3-VL-MoE-style policy (ViT + MoE decoder) learns
`miniwob/click-test` and `miniwob/click-test-2` on 2 CPU cores with the PPO clipped objective and
group-relative advantages (GRPO: 4 episodes per screen); the critic-based PPO variant (decoupled GAE,
report section 2.5.4) is the `:ppo` arg.

  python -m experiments.train --config experiments/configs/miniwob_ppo.py --workdir runs/miniwob_ppo
  python -m experiments.train --config experiments/configs/miniwob_ppo.py:ppo --workdir runs/miniwob_ppo_critic
  python -m experiments.train --config experiments/configs/miniwob_ppo.py:smoke --workdir /tmp/smoke
  python -m experiments.train --config experiments/configs/miniwob_ppo.py --config.rl.lr=1e-4 ...

Exploration aids (documented in README, "Main job"): the constrained grammar allows only `click`
and writes coordinates as three digits ending in 0 (`coord_format='tens3'`), so a random policy clicks
uniformly over the screen; the thought is capped at `grammar.max_thought_bytes` bytes.

Args (`ARGS`): "" (GRPO), "ppo" (critic + decoupled GAE), "smoke" (tiny model and budget, PPO).
This file is where every field's default lives: the code that reads a config has no fallbacks.
"""

import ml_collections as mlc

ARGS = ("", "ppo", "smoke")


def vpt_section(smoke: bool) -> mlc.ConfigDict:
  """The `vpt` section: the value-pretraining stage (experiments/value_pretrain.py; report 2.5.4)."""
  v = mlc.ConfigDict()
  # True: experiments/replicate.py runs value pretraining before PPO and passes its critic as
  # critic.init; experiments/train.py refuses such a config without critic.init.
  v.enabled = False
  v.policy_run = ""  # run dir whose latest checkpoint is the fixed policy; "" = initial policy
  # experiments/replicate.py's stage (and directory) name of this value pretraining, one per training seed,
  # shared by every variant that names it: a variant whose value pretraining differs names its own
  v.stage = "vpt"
  v.max_iterations = 2 if smoke else 30
  v.max_minutes = 30.0 if smoke else 60.0  # guard only (tars_jax/train/guard.py): the budget is max_iterations
  # Stop when `patience` consecutive fresh batches have value loss <= .. and explained var >= ..
  v.stop_value_loss = 0.02
  v.stop_explained_variance = 0.6
  v.patience = 2
  v.lr = 1e-3  # critic learning rate of this stage (rl.critic_lr is the PPO stage's)
  v.epochs = 1 if smoke else 2
  v.minibatch_size = 4 if smoke else 8
  v.value_clip = 0.0  # <= 0: no value clipping (the policy is fixed, no trust region needed)
  v.seed_offset = 5_000_000  # rollout seeds apart from training and evaluation seeds
  v.ckpt_every = 1 if smoke else 5  # critic + optimiser + stop-rule state, for resuming a killed run
  return v


def sft_section(smoke: bool) -> mlc.ConfigDict:
  """The `sft` section: the supervised stages (experiments/sft.py; report sections 2.3-2.4), the
  grounding (CT-style) stage and SFT on demonstrations alike; experiments/configs/miniwob_pipeline.py
  sets it per stage."""
  s = mlc.ConfigDict()
  s.data = ()  # trajectory record dirs trained on (tars_jax/data/records.py), e.g. runs/x/demos
  # continual pre-training (report 2.3, the flywheel's CT set: rejected trajectories): record dirs
  # trained by next-token loss on all their text tokens (tars_jax/train/ct.py), mixed into `data`
  s.ct_data = ()
  # fraction of training batches drawn from `ct_data` (a fixed interleaving, data/pipeline.py `mix`);
  # 0 = plain SFT, 1 = CT only (then `data` stays empty); ct_data and ct_ratio > 0 go together
  s.ct_ratio = 0.0
  s.heldout = ()  # record dirs of held-out examples: their loss every `eval_every` steps
  s.steps = 4 if smoke else 1500
  s.max_minutes = 30.0 if smoke else 60.0  # guard only (tars_jax/train/guard.py; evaluations not counted): the budget is `steps`
  s.batch_size = 4 if smoke else 16
  s.lr = 1e-3
  s.warmup_steps = 2 if smoke else 50
  s.final_lr_fraction = 0.1  # cosine decay to this fraction of lr at `decay_steps`
  s.decay_steps = 0  # length of the cosine in updates; 0 = `steps` (more than `steps`: the run stops mid-decay)
  s.thoughts = False  # train on the records' templated thoughts (True) or empty `Thought: ` (False)
  s.skip_corrupt = False  # a corrupt record: raise (False) or skip and count it (True)
  s.log_every = 1 if smoke else 10
  s.eval_every = 2 if smoke else 250  # held-out loss, grounding accuracy, sandbox success; 0 = off
  s.eval_episodes = 2 if smoke else 32  # sandbox episodes per task of config.tasks at each eval; 0 = none
  s.eval_examples = 8 if smoke else 256  # held-out records scored at each eval (loss, grounding accuracy)
  s.ckpt_every = 2 if smoke else 100
  return s


def data_section(smoke: bool) -> mlc.ConfigDict:
  """The `data` section: what the data stages collect (experiments/demos.py, experiments/grounding.py)."""
  d = mlc.ConfigDict()
  d.demo_tasks = ()  # tasks with a scripted expert (tars_jax/data/sources/experts.py); () = none
  d.demo_seeds = 4 if smoke else 200  # expert episodes attempted per task (only successes are kept)
  d.demo_seeds_rl_tasks = 4 if smoke else 200  # the same for the tasks of `tasks` (the RL stage's)
  d.demo_seeds_by_task = ()  # ((task, seeds), ...): per-task counts over the two above
  d.demo_seed_offset = 2_000_000  # apart from training (0+), vpt (5e6+) and evaluation (1e7+) seeds
  d.demo_max_turns = 8  # step budget of the experts' episodes (login-user takes 5 turns)
  d.grounding_tasks = ()  # MiniWoB++ tasks whose pages yield grounding examples; () = data/sources/grounding.py's list
  d.grounding_seeds = 4 if smoke else 60  # pages per task for training examples
  d.grounding_heldout_seeds = 2 if smoke else 8  # pages per task for held-out examples
  d.grounding_seed_offset = 3_000_000  # training pages; held-out pages from offset + 1e6
  return d


def orm_section(smoke: bool) -> mlc.ConfigDict:
  """The `orm` section: the generative outcome reward model (experiments/orm.py, tars_jax/train/orm.py;
  report sections 2.5.2 and 3.3); experiments/configs/orm.py sets it for its runs."""
  o = mlc.ConfigDict()
  o.data = ()  # record dirs of verifier-labelled trajectories (rollouts, demos): label = Episode.success
  o.heldout = ()  # record dirs of held-out trajectories; () = `heldout_fraction` of data's (task, seed) groups
  o.heldout_fraction = 0.2
  # "length": within each (task, number of turns) stratum keep as many successes as failures (the larger
  # side subsampled, seeded), on the training and the held-out side alike, so that episode length does
  # not give the label away (an ORM on raw rollouts learnt "one turn = success"); "none": keep all
  o.balance = "none"
  o.bootstrap_reps = 20 if smoke else 2000  # bootstrap replicates of the final held-out intervals; 0 = none
  o.screenshots = 5  # the last k turns keep their screenshot (report: 5); older turns as text
  o.max_tokens = 1024  # prompt + answer tokens; over it older turns / screenshots are left out; 0 = no bound
  o.question = "Did the agent complete the task? Answer yes or no."
  o.answers = ("yes", "no")  # (success, failure) answers; the score compares their first tokens
  # the records' thoughts (True) or emptied ones (False: demonstrations have templated thoughts and
  # the policy writes none, which the ORM would otherwise learn instead of the outcome)
  o.thoughts = False
  o.steps = 6 if smoke else 240
  o.max_minutes = 30.0 if smoke else 60.0  # guard only (evaluations not counted): the budget is `steps`
  o.batch_size = 4 if smoke else 16  # half successes, half failures (classes balanced by sampling)
  o.lr = 1e-3
  o.warmup_steps = 2 if smoke else 30
  o.final_lr_fraction = 0.1
  o.log_every = 1 if smoke else 10
  o.eval_every = 3 if smoke else 200  # held-out F1 / precision / recall / FPR; 0 = at the end only
  o.eval_examples = 16 if smoke else 512  # held-out episodes scored (a fixed sample)
  o.ckpt_every = 3 if smoke else 100
  return o


def flywheel_section(smoke: bool) -> mlc.ConfigDict:
  """The `flywheel` section: the data flywheel (experiments/flywheel.py, tars_jax/data/flywheel.py; report
  section 2.3); experiments/configs/flywheel.py sets it for its runs."""
  f = mlc.ConfigDict()
  # Iteration 0's policy: a run dir with checkpoints (an SFT or PPO stage, e.g. runs/main/ppo, or one of
  # its step dirs <run>/checkpoints/<step>); "" = the fresh init of `seed`.
  f.init = ""
  f.iterations = 2 if smoke else 3
  # --- generate: k = seeds_per_task x samples_per_seed samples per task of `tasks` per iteration, through
  # the training rollout path (sampled at sampling.temperature); seeds from seed_offset on, apart from
  # training (0+), demonstrations (2e6+), grounding (3e6+), value pretraining (5e6+) and evaluation (1e7+)
  f.seeds_per_task = 2 if smoke else 64
  f.samples_per_seed = 2
  f.seed_offset = 6_000_000
  # --- validate: the verifiers (environment reward: MiniWoB++, games, desktop checks, browse answers), or
  # an ORM run (experiments/orm.py; tars_jax/train/orm.py) with V = 1[P(yes) > orm_threshold]
  f.orm_run = ""
  f.orm_threshold = 0.5
  f.skip_corrupt = False  # a corrupt staged sample: raise with file and index (False) or skip and count it
  # --- route: the sets start from these record dirs (the report's bootstrap sets, e.g. the main job's
  # runs/main/demos and runs/main/grounding/data/train); generated samples accumulate in
  # <workdir>/data/sft (V = 1) and <workdir>/data/ct (V = 0)
  f.sft_base = ()
  f.ct_base = ()
  # --- CT every ct_every-th iteration (t % ct_every == 0; 0 = never): the CT set mixed into the SFT set,
  # ct_ratio of the batches from CT (sft.ct_data / sft.ct_ratio; CT alone while the SFT set is empty).
  # The report runs CT less often than SFT and RL.
  f.ct_every = 1 if smoke else 2
  f.ct_ratio = 0.5
  f.ct_steps = 1 if smoke else 200
  f.ct_lr = 3e-4
  # --- SFT on the accumulated SFT set, from the previous stage's weights (skipped while the set is empty)
  f.sft_steps = 1 if smoke else 300
  f.sft_lr = 3e-4
  # --- RL (experiments/train.py) from the SFT weights, a short budget per iteration; training seeds of
  # iteration t from (t - 1) * rl_seed_stride (none repeats across iterations); value pretraining of the
  # critic under the SFT policy first (rl.algo 'ppo' only)
  f.rl_iterations = 1 if smoke else 15
  f.rl_minutes = 30.0  # the RL stage's guard (its budget is rl_iterations)
  f.rl_seed_stride = 100_000
  f.value_pretrain = not smoke
  # --- held-out evaluation of each iteration's policy (experiments/eval.py): episodes per task of
  # `tasks`; eval_init: iteration 0's policy too (row 0 of the table; needs `init`)
  f.eval_episodes = 2 if smoke else 100
  f.eval_init = not smoke
  f.stage_timeout_min = 30.0 if smoke else 24 * 60.0  # a stage running longer is killed (the driver stops)
  return f


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  arg = arg or ""
  c = mlc.ConfigDict()
  c.seed = 0
  # jax_default_matmul_precision, set by each trainer before any compute: "float32" = full precision
  # on every backend; "default" = the backend's fast path (TF32 on Ampere+ GPUs, bf16 passes on TPU).
  # On this project's CPUs both give the same error and the same SFT speed (benchmarks/RESULTS.md).
  c.matmul_precision = "float32"
  c.tasks = ("miniwob/click-test", "miniwob/click-test-2")

  # --- Sandbox -----------------------------------------------------------------------------------
  c.env = mlc.ConfigDict()
  c.env.servers = ()  # URLs of running sandbox servers; empty = launch one as a subprocess
  c.env.num_sessions = 32  # concurrent episodes per rollout (= episodes per iteration)
  c.env.step_ms = 1000  # virtual milliseconds advanced per step (Playwright page.clock)
  c.env.lease_s = 600.0
  # Latency model of the launched sandbox servers (envs_bridge/app.py StepLatency): a log-normal wall-clock
  # delay before each step answers, standing in for remote desktop VMs; 0 = none (the page's clock is unaffected)
  c.env.step_latency_median_s = 0.0
  c.env.step_latency_sigma = 1.0
  # standby Chromium holding up to this many pre-made pages, promoted when the browser dies: sessions
  # come back sooner after a kill -9 since their pages already exist; costs a page's memory per page
  # (benchmarks/RESULTS.md, "Crash recovery with a standby browser"); 0 = none
  c.env.spare_pages = 0
  # Chromium processes of the launched server, sessions spread over them: a kill -9 of one loses only
  # its share, and fewer lost sessions come back sooner (benchmarks/RESULTS.md, "Headless shell")
  c.env.browsers = 2
  c.env.max_turns = 2  # step budget per episode
  c.env.train_seed_offset = 0  # training seeds: offset + k, k = 0, 1, 2, ...
  c.env.eval_seed_offset = 10_000_000  # held-out seeds never reached by training
  # the sandbox's instance split of held-out evaluation: 'train' (MiniWoB++: seeds apart are enough) or
  # 'test' (GUI-Browsing: the held-out questions, envs_bridge/browser/browse_tasks.py)
  c.env.eval_data_mode = "train"
  # sandbox servers launched when `servers` is empty: "browser" (MiniWoB++, games, GUI-Browsing) and
  # "desktop" (Xvfb desktop and hybrid tasks); episodes go to a server that serves their task
  c.env.launch = ("browser",)
  c.env.desktop_sessions = 8  # the desktop server's --max-sessions (one Xvfb each)
  c.env.desktop_step_ms = 300  # real milliseconds waited after each desktop action

  # --- Memory (tars_jax/agent/memory.py; report section 2.1) -------------------------------------
  # Off by default (every prompt is the full history, as before). working_turns = K screenshots per
  # prompt, this turn's included (UI-TARS keeps 5), older turns as thought/action text; a rebuilt
  # prompt is trained as its own row (tars_jax/agent/trajectory.py), so PPO sees exactly it.
  c.memory = mlc.ConfigDict()
  c.memory.working_turns = 0  # 0 = every screenshot
  c.memory.max_context_tokens = 0  # prompt + reserve_tokens never above this; 0 = no budget
  c.memory.reserve_tokens = 0  # room for the reply inside max_context_tokens (e.g. the grammar's longest)
  # "off" | "template" (task, actions, outcome) | "policy" (the policy's reply to a summary prompt)
  c.memory.episodic = "off"
  c.memory.episodic_episodes = 3  # summaries kept per task (the latest)
  c.memory.episodic_max_tokens = 128  # summaries fed into one episode prefix, in tokens
  c.memory.summary_max_tokens = 48  # one summary, in tokens

  # --- Streaming rollouts (tars_jax/rollout/pool.py, inference_server.InferenceService; report 2.5.3) ---
  # Off: every iteration plays env.num_sessions episodes in lockstep (reproducible from the seed). On:
  # episodes run continuously through a continuous-batching inference service while the trainer
  # updates; an update takes the first finished groups holding >= min_batch episodes.
  c.rollout = mlc.ConfigDict()
  c.rollout.streaming = False
  c.rollout.concurrency = 0  # episodes in flight; 0 = env.num_sessions
  c.rollout.min_batch = 0  # episodes per update; 0 = env.num_sessions
  c.rollout.max_staleness = 1  # policy versions a token may lag the trained policy
  c.rollout.stale = "drop"  # "drop": a too-stale episode is dropped and counted; "mask": its old tokens
  c.rollout.max_failed_in_a_row = 16  # episodes failing every attempt in a row: the fleet is down, stop
  c.rollout.slots = 0  # KV-cache slots of the inference service; 0 = concurrency
  c.rollout.context_len = 0  # cache positions per slot; 0 = Parts.context_capacity()
  c.rollout.inference = ""  # "": the policy sampled in this process; "http://host:port": by experiments/serve.py
  c.rollout.inference_timeout_s = 120.0  # a remote service silent this long: InferenceUnavailable, the run stops

  # --- Model (tars_jax/models/config.py fields) -----------------------------------------------------
  c.model = mlc.ConfigDict()
  c.model.image_h = 224
  c.model.image_w = 168
  c.model.patch_size = 14
  c.model.vision_hidden = 96
  c.model.vision_depth = 2
  c.model.vision_heads = 4
  c.model.vision_mlp = 192
  # Patches merged 2x2 into one decoder token (Qwen3-VL's own value): 224 x 168 -> 8 x 6 = 48 image
  # tokens per screenshot. 1 (16 x 12 = 192 tokens) learns click-test-2 in fewer updates but costs
  # twice the CPU time per update (benchmarks/RESULTS.md, "Which model for click-test-2").
  c.model.spatial_merge_size = 2
  c.model.hidden = 128
  c.model.layers = 4
  c.model.heads = 4
  c.model.kv_heads = 2
  c.model.head_dim = 32
  c.model.experts = 4
  c.model.top_k = 2
  c.model.moe_intermediate = 128
  c.model.norm_topk_prob = True
  c.model.decoder_sparse_step = 1
  c.model.rope_theta = 10000.0
  # Per-channel normalisation of [0, 1] pixels, (x - mean) / std (the image processor's), with the
  # statistics of the tasks' own screenshots (64 click-test / click-test-2 screens: mostly white, R = G,
  # B lower for the yellow instruction bar), as CLIP's come from its data. With the processor default
  # 0.5 / 0.5, MiniWoB's light-grey buttons on white barely move the patch embeddings and a policy
  # trained from scratch never learns to point (benchmarks/RESULTS.md, "Image dependence"). None =
  # the family's processor default.
  c.model.image_mean = (0.98, 0.98, 0.75)
  c.model.image_std = (0.094, 0.094, 0.42)
  c.model.scan_layers = False  # True: decoder layers stacked and run by lax.scan (ModelConfig docstring)
  # MoE compute (ModelConfig.moe_impl): "dense" exact reference; "grouped" exact, the fastest CPU train
  # step and decode where the experts' FLOPs dominate; "blocked" its decode paths; "ragged" for expert
  # parallelism on a mesh. With this config's few small experts "dense" costs no more than the grouped
  # loop's bookkeeping and compiles sooner (benchmarks/RESULTS.md, "MoE implementation in the RL
  # loop").
  c.model.moe_impl = "dense"
  # With "ragged" on a mesh with an expert axis: "gspmd" (the compiler partitions it) or "all_to_all"
  # (explicit token dispatch in a shard_map, tars_jax/models/fast/expert_parallel.py).
  c.model.moe_dispatch = "gspmd"

  # --- Output grammar (tars_jax/agent/grammar.py) ----------------------------------------------------
  c.grammar = mlc.ConfigDict()
  c.grammar.constrained = True
  c.grammar.actions = ("click",)
  c.grammar.max_thought_bytes = 0
  c.grammar.max_content_bytes = 16
  c.grammar.coord_format = "tens3"

  c.sampling = mlc.ConfigDict()
  c.sampling.temperature = 1.0
  c.sampling.top_p = 1.0  # PPO log-probs assume top_p = 1 (the sampled distribution)
  # Decode step = 1 sampled token + up to 7 grammar-forced ones (same distribution, fewer model
  # calls). On CPU much longer chunks cost more than the calls they save (benchmarks/RESULTS.md,
  # "Jump-forward decoding"); 1 = token by token.
  c.sampling.jump_forward = 8
  # Serving weights of the rollout policy (tars_jax/models/inference/quant.py): None = as trained (float32);
  # "int8" (W8A8), "int4" (W4A8, report section 3), "int8_weight_only", "int4_weight_only". The
  # trainer's parameters stay float; tokens/s and logit error: benchmarks/RESULTS.md, "Quantised inference".
  c.sampling.quantize = mlc.config_dict.placeholder(str)

  # --- RL ------------------------------------------------------------------------------------------
  c.rl = mlc.ConfigDict()
  c.rl.algo = "grpo"  # "ppo" (critic + GAE) | "grpo" | "drgrpo" | "rloo" (group-relative, no critic)
  # episodes per (task, seed) group, i.e. per screen: >= 2 for the group-relative algos, 1 for ppo
  c.rl.group_size = 4
  c.rl.lr = 5e-4
  c.rl.critic_lr = 1e-3
  c.rl.warmup_steps = 10
  c.rl.weight_decay = 0.0
  c.rl.max_grad_norm = 1.0
  c.rl.gamma = 1.0
  # Decoupled GAE (report section 2.5.4, VC-PPO): lambda_critic = 1 gives unbiased value targets,
  # lambda_policy < 1 lowers the variance of the policy's advantages. Used by algo "ppo" only.
  c.rl.lam_policy = 0.95
  c.rl.lam_critic = 1.0
  # VAPO length-adaptive lam_policy = 1 - 1/(alpha * free decisions); unset (None) = off.
  c.rl.length_adaptive_alpha = mlc.config_dict.placeholder(float)
  c.rl.whiten_advantages = True
  c.rl.clip_low = 0.2
  c.rl.clip_high = 0.28  # clip-higher (DAPO), report section 2.5.4
  c.rl.clip_c = mlc.config_dict.placeholder(float)  # dual-clip constant (unset/None = off)
  c.rl.value_clip = 0.2  # <= 0 = off
  c.rl.vf_coef = 1.0
  c.rl.ent_coef = 0.02
  c.rl.aux_loss_coef = 0.01  # MoE load-balance loss
  c.rl.loss_agg = "token-mean"
  c.rl.kl_kind = "k3"  # KL to the initial policy: k1 | k2 | k3 | abs
  c.rl.kl_coef = 0.0  # 0 = no KL term
  # policy gradient on the highest-entropy fraction of free decisions only (Wang et al. 2025: 0.2)
  c.rl.top_entropy_frac = 1.0
  # no policy gradient on the characters a type() reply types (rl/typed_text.py; an ablation, issue #37)
  c.rl.skip_typed_text = False
  # PPO-ptx (Ouyang et al. 2022, eq. 2): + ptx_coef x the SFT cross-entropy of a batch of demonstrations
  # (records in ptx_data, ptx_batch_size episodes) in every policy step, so the skills the reward does not
  # reinforce stay learnt; 0 = off.
  c.rl.ptx_coef = 0.0
  c.rl.ptx_data = ()
  c.rl.ptx_batch_size = 8
  # Decoupled PPO (Hilton et al. 2022; AReaL): clip around the pre-update policy, behaviour log-probs as
  # an importance weight; meant for stale streaming rollouts (rollout.streaming). False: ratio to behaviour.
  c.rl.decoupled = False
  # With decoupled: tokens whose weight pi_prox / pi_behaviour exceeds this leave the loss (AReaL's
  # behav_imp_weight_cap, 5 in its examples); None keeps every token.
  c.rl.behaviour_weight_cap = 5.0
  # The vision encoders of policy and critic stay as SFT / value pretraining left them: their screenshot
  # features are computed once per rollout batch instead of in every minibatch step (no encoder backward).
  c.rl.freeze_vision = False
  # PPO: a per-task baseline on top of the critic's (each episode's advantages minus its task's mean in
  # the batch, before whitening): for a critic that does not yet tell the tasks apart. The offset it
  # removes is logged either way (train/advantage_task_offset).
  c.rl.task_baseline = False
  c.rl.epochs = 2
  c.rl.minibatch_size = 16
  # Minibatches of rows of similar length (tars_jax/train/ppo.py `minibatch_rows`): each is cut to its
  # own longest row instead of the batch's longest episode. False: the plain random permutation.
  c.rl.minibatch_by_length = True
  # "raw": MiniWoB's page reward (-1..1); "success": 1 for a success, 0 otherwise (tars_jax/rl/rewards.py)
  c.rl.outcome = "raw"
  c.rl.outcome_weight = 1.0
  c.rl.format_penalty = -0.1
  c.rl.truncation_reward = -1.0
  c.rl.step_penalty = 0.0  # added every turn (step-budget shaping; 0 = off)
  c.rl.overlong_weight = 0.0  # DAPO soft overlong thought penalty (0 = off)
  c.rl.overlong_max_tokens = 0
  c.rl.overlong_buffer = 0
  # Outcome reward from a generative ORM instead of the verifier (tars_jax/train/orm.py; report 2.5.2):
  # an experiments/orm.py run dir; its P(yes) replaces each episode's outcome term by
  # lo + P(yes) * (hi - lo), (lo, hi) = orm_reward_range, the verifier's (failure, success) rewards
  # (MiniWoB: -1 / +1). "" = the verifier's reward. The verifier's outcome is still logged
  # (success_rate, rollout/verifier_success) beside the ORM's (orm/*).
  c.rl.orm_run = ""
  c.rl.orm_reward_range = (-1.0, 1.0)

  c.policy = mlc.ConfigDict()
  # Initial policy: a run dir (its latest checkpoint, e.g. an experiments/sft.py run) or one of its
  # checkpoint step dirs (<run>/checkpoints/<step>); "" = random init from `seed`. The KL reference
  # is this policy; a run's own checkpoint (resume) takes precedence.
  c.policy.init = ""

  c.critic = mlc.ConfigDict()
  c.critic.init = ""  # critic checkpoint of experiments/value_pretrain.py (<workdir>/critic); "" = random

  # --- Mesh (tars_jax/sharding.py) ---------------------------------------------------------------
  # shape = (data, fsdp, tensor, expert) device counts, () = one device (e.g. --config.mesh.shape=
  # "(2,1,2,2)"); rules re-map logical axes to mesh axes, e.g. {"mlp": "fsdp"} (sharding.DEFAULT_RULES).
  c.mesh = mlc.ConfigDict({"shape": (), "rules": {}})

  # --- Vertical agents (experiments/merge_eval.py; report section 2.6) ------------------------------
  # {vertical: {"tasks": (...), "max_turns": n}}: the task sets of a merge experiment, each played with
  # its step budget (experiments/configs/verticals.py, verticals_miniwob.py); empty elsewhere.
  c.verticals = mlc.ConfigDict()

  # --- Processes (tars_jax/distributed.py; docs/running.md, "Multi-process runs") ------------------------------
  # num_processes: 1 = one process (nothing started); N > 1 = N processes (one per host or device
  # group) through jax.distributed, the mesh spanning all of them and each driving its share of
  # env.servers; 0 = count, id and coordinator auto-detected from the cluster (SLURM, Open MPI).
  c.distributed = mlc.ConfigDict()
  c.distributed.num_processes = 1
  c.distributed.process_id = -1  # this process's rank in [0, num_processes); -1 = auto-detected
  c.distributed.coordinator_address = ""  # "host:port" of process 0; "" = $JAX_COORDINATOR_ADDRESS or auto
  # seconds without heartbeats after which a process counts as dead and every other one stops, naming
  # it (JAX's default); re-running the launch command resumes from the last checkpoint
  c.distributed.heartbeat_timeout_s = 100
  c.distributed.initialization_timeout_s = 300  # seconds to wait for every process to connect
  c.distributed.cpu_collectives = "gloo"  # cross-process collectives of CPU runs: "gloo" | "mpi"

  # --- Run -----------------------------------------------------------------------------------------
  c.iterations = 125  # ~4 000 episodes
  c.max_minutes = 60.0  # guard only (tars_jax/train/guard.py): stops loudly, the budget is `iterations`
  c.ckpt_every = 10
  c.keep_checkpoints = 3
  # every trained episode as a trajectory record in <workdir>/rollouts (tars_jax/data/records.py:
  # screenshots, ids, behaviour log-probs, rewards, policy version), the flywheel's raw material
  c.record_rollouts = True
  c.log_trajectories = 4  # episodes (with screenshots) saved per iteration for inspection
  c.save_trajectories_every = 5
  # In-training eval every `eval_every` iterations (0 = off): `eval_episodes` held-out seeds per task
  # (env.eval_seed_offset + k), logged as eval/<task>/success; experiments/eval.py does the full one.
  c.eval_every = 25
  c.eval_episodes = 16
  # Held-out seeds per task of a driver's final evaluation of each run (experiments/replicate.py).
  c.final_eval_episodes = 200
  # Image dependence of the policy's decisions (tars_jax/analysis/image_dependence.py), measured on
  # the iteration's rollout batch before its update, every this many iterations (iteration 1 = the
  # initial policy; 0 = off): logged as image_dependence/{layer<i>,final,tv,max_dlogit}.
  c.image_dependence_every = 10
  c.length_multiple = 64

  if arg in ("ppo", "smoke"):  # critic-based PPO: GAE with decoupled lambdas, one episode per seed
    c.rl.algo = "ppo"
    c.rl.group_size = 1
    c.rl.ent_coef = 0.05
  if arg == "smoke":
    c.env.num_sessions = 4
    c.env.max_turns = 2
    c.iterations = 2
    c.rl.minibatch_size = 4
    c.rl.epochs = 1
    c.ckpt_every = 1
    c.model.layers = 2
    c.model.hidden = 64
    c.model.head_dim = 16
    c.model.moe_intermediate = 64
    c.model.vision_hidden = 48
    c.model.vision_mlp = 96
    c.model.vision_depth = 1
    c.log_trajectories = 1
    c.save_trajectories_every = 1
    c.eval_every = 0
    c.eval_episodes = 2
    c.final_eval_episodes = 2
    c.image_dependence_every = 1
  elif arg not in ("", "ppo"):
    raise ValueError(f"unknown config arg {arg!r}; expected one of {ARGS}")
  c.vpt = vpt_section(smoke=arg == "smoke")
  c.sft = sft_section(smoke=arg == "smoke")
  c.data = data_section(smoke=arg == "smoke")
  c.flywheel = flywheel_section(smoke=arg == "smoke")
  c.orm = orm_section(smoke=arg == "smoke")
  return c
