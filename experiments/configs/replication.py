r"""The replication suite (issue #37, docs/replication.md rows 1-5): the report's RL findings tested
where RL has headroom. SFT from a deliberately limited demonstration budget, then RL variants from the
same SFT checkpoint of each training seed, every budget a count.

  bash scripts/replicate.sh                                   # runs/replication, 3 seeds, every variant
  SEEDS=0,1,2,3,4 VARIANTS=ppo,grpo bash scripts/replicate.sh  # more seeds, two variants
  MOD=smoke RUN=/tmp/rep bash scripts/replicate.sh            # tiny model and budgets (CI)

Stages per training seed `s` (experiments/replicate.py runs them, resumable, skipping finished ones):
  demos (shared by all seeds) -> sft/seed_s -> vpt/seed_s (variants with value pretraining)
  -> <variant>/seed_s (RL) -> eval of sft/seed_s and of every <variant>/seed_s on the held-out seeds.

Args: "sft" = the SFT stage (and the demonstration budget); a variant of `VARIANTS` = its RL stage:
  ppo           critic PPO, decoupled GAE (lam_policy 0.95, lam_critic 1.0), value pretraining first
  grpo          GRPO, no critic (4 episodes per seed, the same episodes per iteration)
  ppo_novpt     ppo without value pretraining (the critic starts from its random init)
  ppo_coupled   ppo with coupled lambda (lam_policy = lam_critic = 0.95)
  ppo_lenadapt  ppo with length-adaptive lam_policy (VAPO alpha = 0.05)
  ppo_kl        ppo with a KL penalty to the SFT policy (k3, coefficient 0.3): keeps the skills RL does
                not reinforce (enter-text's copying fell to 0.00-0.02 under `ppo` and `grpo`)
  ppo_topent    ppo with the policy gradient on the top 20 % highest-entropy free decisions of each
                minibatch (Wang et al. 2025): RL moves the uncertain choices (where to click), not the
                near-certain ones a failed episode shares with successes (the copied text)
  ppo_kl_topent ppo_kl and ppo_topent together
  ppo_kl_1ep    ppo_kl with 1 epoch per batch and 50 iterations instead of 2 and 30: within the same
                wall budget, 1.7x the episodes at 0.83x the updates (fresh episodes over re-used ones)
  grpo_kl       grpo with the same KL penalty (row 2 at the KL setting: PPO vs GRPO both anchored)
  ppo_kl_mc     ppo_kl with lam_policy 1 (each token's advantage = the episode's return - V(s_t)): GAE runs
                over every reply token, ~170 per episode here, and 0.95^170 ~ 2e-4 leaves the outcome's
                credit for all but the last turn's tokens to a critic whose value-return correlation
                is 0.2-0.4
  ppo_kl_ptx    ppo_kl with PPO-ptx (Ouyang et al. 2022): every policy step also descends the SFT loss
                of a batch of 8 of the suite's demonstrations (coefficient 1): under ppo_kl, enter-text's
                exact copies of the quoted name fell from 0.33-0.42 to 0.05-0.23 of episodes
  ppo_ptx       ppo with PPO-ptx and no KL penalty: the demonstrations, not the SFT policy, anchor the
                skills RL does not reinforce, so the rewarded ones (where to click) can move further
  ppo_thoughts  ppo on the SFT stage that kept the templated thoughts (think length logged)
  ppo_fv        ppo with both vision encoders frozen in RL (`rl.freeze_vision`): screenshot features once per
                rollout batch, no encoder forward or backward in the minibatch steps (issue #37 item 1's
                cheaper update); beside `ppo` on the same seeds it shows whether the update still learns
                what `ppo` learns
  ppo_notext    ppo without the policy gradient on the characters a type() reply types
                (`rl.skip_typed_text`): whether RL's erosion of the copied names (exact copies 0.54 -> 0.33
                under `ppo_ptx` on the multi-turn suite) comes from the gradient on those characters
  ppo_lr1e4     ppo at a third of its learning rate (1e-4): smaller steps per update, whether they keep the
                copied names `ppo` erodes on the multi-turn suite and still move the one-screen tasks
  ppo_lr1e4_vpt30  ppo_lr1e4 after 30 iterations of value pretraining instead of 10 (its own stage, vpt30/): after
                10 (80 critic steps) the critic's value at an episode's first decision was one constant on every
                task of the multi-turn suite on two of three seeds (0.34-0.36 where success is 0.09-0.70,
                experiments/critic_by_task.py): a baseline that removes none of the returns' between-task variance
  ppo_lr1e4_fv  ppo_lr1e4 with both vision encoders frozen (`rl.freeze_vision`, as ppo_fv): beside ppo_lr1e4 on
                the same seeds, whether the cheaper update (1.4x less update time) learns what it learns
  ppo_lr1e4_task  ppo_lr1e4 with a per-task baseline (`rl.task_baseline`): each episode's advantages lose the
                mean advantage of its task's episodes in the batch, the between-task offset a critic that does
                not tell the tasks apart leaves in; the other route to the same baseline as ppo_lr1e4_vpt30
  ppo_lr1e4_ptx ppo_lr1e4 with PPO-ptx (as ppo_ptx): the smaller steps keep most copied names and the one-screen
                gains; the demonstrations' SFT loss anchors the copies the remaining steps still erode
  ppo_lr1e4_ptx50  ppo_lr1e4_ptx for 50 iterations instead of 30: its training success still rose at iteration 30
                (0.38 / 0.41 / 0.44 over iterations 1-10 / 11-20 / 21-30 on seed 0); 50 x ~15 s fills the
                suite's 15-minute RL budget on the 2-core Zen 5 VM
"+smoke" appended = tiny model and budgets.

Tasks: RL and evaluation on MiniWoB++ tasks where the SFT start is partial (0.3-0.5 on training seed 0)
(benchmarks/RESULTS.md, "Replication suite: a task set with headroom"): click-test, focus-text,
click-test-2, focus-text-2 (one step, no demonstrations: the skill transfers from the demonstration
tasks) and enter-text (3 steps, 240 demonstrations; 0.08 on seed 0, 0.23-0.37 on earlier SFT runs). SFT: 800 updates on 40 demonstrations of each of
7 tasks (240 of each typing task).
"""

import ml_collections as mlc

from experiments.configs import miniwob_pipeline

VARIANTS = ("ppo", "grpo", "ppo_novpt", "ppo_coupled", "ppo_lenadapt", "ppo_kl", "grpo_kl", "ppo_topent",
            "ppo_kl_topent", "ppo_kl_1ep", "ppo_kl_mc", "ppo_kl_ptx", "ppo_ptx", "ppo_thoughts", "ppo_fv",
            "ppo_notext", "ppo_lr1e4", "ppo_lr1e4_fv", "ppo_lr1e4_vpt30", "ppo_lr1e4_task",
            "ppo_lr1e4_ptx", "ppo_lr1e4_ptx50")
STAGES = ("sft", "sft_thoughts", *VARIANTS)
ARGS = (*STAGES, *(s + "+smoke" for s in STAGES))

# RL and evaluation: tasks on which the SFT policy succeeds partly, 0.3-0.5 (benchmarks/RESULTS.md,
# "Replication suite: a task set with headroom"); the suite's earlier tasks (click-button, click-link,
# click-checkboxes) left RL nothing to reinforce: the SFT policy's failures there were systematic.
TASKS = ("miniwob/click-test", "miniwob/focus-text", "miniwob/click-test-2", "miniwob/focus-text-2",
         "miniwob/enter-text")
# Demonstrations: 40 of each of 7 tasks, 240 of each typing task (copying the instruction's text into
# type() starts between 400 and 800 updates with them). Only enter-text is also an RL task: click-tab is
# solved from them, login-user's and enter-password's random passwords are not copied (0.0).
DEMO_TASKS = ("miniwob/click-button", "miniwob/click-link", "miniwob/click-tab", "miniwob/enter-text",
              "miniwob/login-user", "miniwob/enter-password", "miniwob/click-checkboxes")
TYPING = ("miniwob/enter-text", "miniwob/login-user", "miniwob/enter-password")


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  stage, smoke = miniwob_pipeline.stage_arg(arg or "ppo", STAGES)
  thoughts = stage in ("sft_thoughts", "ppo_thoughts")
  c = miniwob_pipeline.get_config(("thoughts" if thoughts else "") + ("+smoke" if smoke else ""))
  c.tasks = ("miniwob/click-button", "miniwob/enter-text") if smoke else TASKS
  c.env.max_turns = 6  # login-user and enter-password take 5 steps
  c.env.num_sessions = 4 if smoke else 32

  # --- Demonstrations: a limited budget per task (the demonstrations-then-RL setting) ---------------
  c.final_eval_episodes = 2 if smoke else 100  # held-out seeds per task for every SFT and RL evaluation
  c.data.demo_tasks = c.tasks if smoke else DEMO_TASKS
  c.data.demo_seeds = c.data.demo_seeds_rl_tasks = 2 if smoke else 40  # expert episodes per task (successes kept)
  c.data.demo_seeds_by_task = () if smoke else tuple((t, 240) for t in TYPING)
  c.data.demo_max_turns = 7

  # --- SFT on them: an update count, not minutes (max_minutes only guards a hung host) ---------------
  c.sft.data = ()  # experiments/replicate.py passes the demonstrations' directory
  c.sft.heldout = ()
  c.sft.steps = 4 if smoke else 800
  c.sft.decay_steps = 0
  c.sft.lr = 3e-3
  c.sft.eval_every = 0
  c.sft.eval_episodes = 0
  c.sft.ckpt_every = 2 if smoke else 50  # ~3 min of updates at most lost to a kill (~1 s per checkpoint)
  c.sft.max_minutes = 30.0 if smoke else 60.0

  # --- RL from the SFT checkpoint ---------------------------------------------------------------------
  c.rl.algo, c.rl.group_size = "ppo", 1
  c.vpt.enabled = stage.startswith("ppo") and stage != "ppo_novpt"
  c.vpt.max_iterations = 2 if smoke else 10
  c.vpt.ckpt_every = 1
  c.iterations = 2 if smoke else 30  # x 32 episodes (~190 per task)
  c.max_minutes = 30.0 if smoke else 60.0  # guard only (tars_jax/train/guard.py)
  c.ckpt_every = 1  # a kill loses one RL iteration at most (a few MB per checkpoint)
  # lr 3e-4 without an entropy bonus: on tasks with a partial skill it raised success by ~0.15 in 20
  # iterations; with ent_coef 0.01 it undid the SFT policy (benchmarks/RESULTS.md, "Replication suite")
  c.rl.lr = 3e-4
  # The suite's metric is success: with MiniWoB's raw reward and the -1 time-out, a policy that
  # succeeds less than half the time scores more by ending its episodes with `finished` (0) than by
  # trying (-1 per miss), and RL learnt exactly that (benchmarks/RESULTS.md, "Replication suite: the
  # reward RL optimised"). Success 1, any failure (a miss, a time-out, giving up) 0.
  c.rl.outcome = "success"
  c.rl.truncation_reward = 0.0
  c.rl.ent_coef = 0.0
  c.rl.minibatch_size = 4 if smoke else 8  # 8 updates per epoch of 32 episodes
  c.eval_every = 0 if smoke else 10  # held-out success curves (8 seeds per task); the final one: eval.json
  c.eval_episodes = 2 if smoke else 8
  if stage in ("grpo", "grpo_kl"):
    c.rl.algo, c.rl.group_size = "grpo", 2 if smoke else 4
  elif stage == "ppo_coupled":
    c.rl.lam_policy = c.rl.lam_critic = 0.95
  elif stage == "ppo_lenadapt":
    c.rl.length_adaptive_alpha = 0.05
  if stage in ("ppo_kl", "grpo_kl", "ppo_kl_topent", "ppo_kl_1ep", "ppo_kl_mc", "ppo_kl_ptx"):
    c.rl.kl_kind, c.rl.kl_coef = "k3", 0.3
  if stage == "ppo_kl_mc":
    c.rl.lam_policy = 1.0
  if stage in ("ppo_kl_ptx", "ppo_ptx", "ppo_lr1e4_ptx", "ppo_lr1e4_ptx50"):  # rl.ptx_data: experiments/replicate.py passes the demonstrations' directory
    c.rl.ptx_coef, c.rl.ptx_batch_size = 1.0, 2 if smoke else 8
  if stage == "ppo_kl_1ep":
    c.rl.epochs = 1
    c.iterations = 2 if smoke else 50
  if stage == "ppo_lr1e4_ptx50":
    c.iterations = 3 if smoke else 50
  if stage in ("ppo_fv", "ppo_lr1e4_fv"):
    c.rl.freeze_vision = True
  if stage == "ppo_notext":
    c.rl.skip_typed_text = True
  if stage in ("ppo_lr1e4", "ppo_lr1e4_fv", "ppo_lr1e4_vpt30", "ppo_lr1e4_task",
            "ppo_lr1e4_ptx", "ppo_lr1e4_ptx50"):
    c.rl.lr = 1e-4
  if stage == "ppo_lr1e4_task":
    c.rl.task_baseline = True
  if stage == "ppo_lr1e4_vpt30":
    c.vpt.max_iterations, c.vpt.stage = 2 if smoke else 30, "vpt30"
  if thoughts:
    c.vpt.stage = "vpt_thoughts"
  if stage in ("ppo_topent", "ppo_kl_topent"):
    c.rl.top_entropy_frac = 0.2
  return c
