r"""Data flywheel driver (UI-TARS-2 report section 2.3, the flywheel figure; issue #28): iterations of
generate -> validate -> route -> CT (every `flywheel.ct_every`-th iteration) -> SFT -> RL -> held-out
evaluation, one linear script; every stage a resumable subprocess run under one parent dir.

  python -m experiments.flywheel --config experiments/configs/flywheel.py --workdir runs/flywheel \
      --config.flywheel.init=runs/main/ppo --config.flywheel.sft_base="('runs/main/demos',)"
  python -m experiments.flywheel --config experiments/configs/flywheel.py:smoke --workdir /tmp/fw   # CI size
  python -m experiments.flywheel ... --config.rollout.inference=http://127.0.0.1:8800   # experiments/serve.py

Iteration t (1-based) under R = --workdir, with P = iteration t-1's policy (t = 1: `flywheel.init`, a run
dir, or "" = the config's fresh init):

  R/iter_<t>/generate   k samples per task from P through the training rollout path, validated (the
                        verifiers, or the ORM of `flywheel.orm_run`) and routed: V = 1 -> R/data/sft,
                        V = 0 -> R/data/ct (tars_jax/data/flywheel.py; counts.json). Run as
                        `python -m experiments.flywheel ... --generate=<t> --policy=P`
  R/iter_<t>/ct         (t % ct_every == 0, CT set not empty) experiments/sft.py from P on the CT set mixed
                        into the SFT set at `ct_ratio` (`sft.ct_data`, `sft.ct_ratio`)
  R/iter_<t>/sft        (SFT set not empty) experiments/sft.py on the accumulated SFT set (`sft_base` + R/data/sft)
                        from the previous stage's weights
  R/iter_<t>/vpt        (`value_pretrain`, rl.algo 'ppo') experiments/value_pretrain.py under the SFT policy
  R/iter_<t>/ppo        experiments/train.py from the SFT weights (and the vpt critic), `rl_iterations`
  R/iter_<t>/eval       experiments/eval.py: `eval_episodes` held-out seeds per task (eval.json)
  R/iter_0/eval         (`eval_init`) the same for iteration 0's policy

With `rollout.inference` every stage that samples (generate, vpt, ppo, eval) uses that service, each
pushing its policy's weights first.
The driver launches one sandbox fleet (`env.launch`; or uses `env.servers`) and hands its URLs to every
stage. A stage that finished (`tars_jax.train.run.is_done`: its done.json) is skipped on a re-run; a killed one is run
again and resumes from its own checkpoints (the generate stage from its committed samples). The driver's
`--config.*` overrides are passed on to every stage, then the stage's own fields (data dirs, initial
policy, steps, learning rate, seeds).

After each iteration: R/flywheel.json (a row per iteration: samples, V = 1 / V = 0 / lost counts, V = 1
fraction overall and per task, SFT and CT set sizes after the iteration, stages run, held-out success per
task) and the table on stdout; at the end R/flywheel.png (experiments/plot.py `flywheel_figure`).
Raises SystemExit naming the stage when one fails (re-run the command to resume).
"""

from __future__ import annotations

import contextlib
import json
import logging as std_logging
import os
import subprocess
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from tars_jax.data import flywheel as fw_lib
from tars_jax.data import records
from tars_jax.data.flywheel_cli import config_spec, format_table, forwarded_overrides, pct
from tars_jax.train import run as run_lib
from tars_jax.train.metrics import write_json

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiments/configs/flywheel.py[:arg].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Parent run directory of the flywheel (created; resumed).")
_GENERATE = flags.DEFINE_integer("generate", None, "Run only the generate stage of this iteration (the "
                                 "driver's subprocess).")
_POLICY = flags.DEFINE_string("policy", "", "With --generate: the run dir of the sampling policy ('' = fresh "
                              "init of config.seed).")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN_SEED = 11  # the generation's sampling keys: fold_in(PRNGKey(config.seed + GEN_SEED), t)


def iter_dir(root: str, t: int) -> str:
  return os.path.join(root, f"iter_{t:02d}")


# ------------------------------------------------------------------------------------------------------
# The generate stage (its own process: `--generate=<t>`).
# ------------------------------------------------------------------------------------------------------

def generate_stage(config, root: str, t: int, policy_run: str) -> fw_lib.IterationCounts:
  """Samples, validates and routes iteration t (tars_jax/data/flywheel.py); writes
  iter_<t>/generate/counts.json last. Samples already committed (a re-run after a kill) are routed
  again without sampling (the sets skip what they already hold)."""
  fw = config.flywheel
  gen = os.path.join(iter_dir(root, t), "generate")
  samples = os.path.join(gen, "samples")
  t0 = time.time()
  validator = "orm" if fw.orm_run else "verifier"
  if not records.prefix_committed(samples, "samples"):
    import jax
    from envs_bridge.launch import env_fleet
    from tars_jax.rollout import evaluation
    from tars_jax.train import state as state_lib
    jax.config.update("jax_default_matmul_precision", config.matmul_precision)
    parts = state_lib.build(config)
    state = parts.init_state(config.seed)
    src = f"fresh init (seed {config.seed})"
    if policy_run:
      state, src = state_lib.load_policy(state, policy_run, parts.popt)
    print(f"[flywheel] iteration {t}: sampling with {src}")
    n = config.env.num_sessions
    pol = parts.batched_policy(state["policy"], batch_size=n, seed=config.seed + GEN_SEED)
    pol.start_iteration(t)
    jobs = fw_lib.sample_jobs(list(config.tasks), fw.seeds_per_task, fw.samples_per_seed, t, fw.seed_offset,
                              config.env.eval_seed_offset)
    # rollout.inference=<url>: sampled by experiments/serve.py (keys its own: no replay from the seed)
    remote = parts.remote_policy(state["policy"], t - 1) if config.rollout.inference else None
    try:
      with env_fleet(config.env) as (loop, clients):
        if remote is not None:  # each sample one session on the server (multi-turn KV reuse)
          eps = evaluation.play_sessions(loop, remote, clients, jobs, parts.loop_cfg, parts.tokenizer, sessions=n,
                                         version=t - 1, progress="flywheel samples")
        else:
          eps = evaluation.play(loop, pol.act, clients, jobs, parts.loop_cfg, parts.tokenizer, sessions=n,
                                version=t - 1, progress="flywheel samples")
    finally:
      if remote is not None:
        remote.close()
    p_yes = None
    if fw.orm_run:
      from tars_jax.train import orm  # the ORM validator (issue #28 item 4), only when asked for
      scorer = orm.OrmScorer.from_run(fw.orm_run)  # under the ORM run's own config.json (model, prompt)
      v, p_yes = fw_lib.orm_verdicts(eps, scorer, fw.orm_threshold)
    else:
      v = fw_lib.verify(eps)
    meta = records.DatasetMeta.for_model(parts.image_hw, parts.loop_cfg.n_img_tokens, parts.tokenizer)
    fw_lib.write_samples(samples, eps, v, meta, iteration=t, validator=validator,
                         policy=src, p_yes=p_yes)
  counts = fw_lib.route_records(samples, root, t, skip_corrupt=fw.skip_corrupt)
  out = dict(counts.as_dict(), validator=validator, policy=policy_run,
             seconds=time.time() - t0)
  with open(os.path.join(gen, "counts.json"), "w") as f:
    json.dump(out, f, indent=1)
  print(f"[flywheel] iteration {t}: {counts.generated} samples, V=1 {counts.v1}, V=0 {counts.v0}, "
        f"lost {counts.lost}" + (f", corrupt skipped {counts.corrupt}" if counts.corrupt else "")
        + f" | sets: {root}/data/{{sft,ct}}")
  return counts


# ------------------------------------------------------------------------------------------------------
# The driver.
# ------------------------------------------------------------------------------------------------------

def _tuple(xs) -> str:
  return repr(tuple(str(x) for x in xs))


@contextlib.contextmanager
def sandboxes(env):
  """A callable returning the URLs of the fleet: `env.servers`, or servers of the kinds of `env.launch`
  launched here on first use (stopped on exit)."""
  from envs_bridge import launch
  handles = []

  def urls() -> list[str]:
    if env.servers:
      return list(env.servers)
    if not handles:
      for kind in env.launch:
        if kind == "browser":
          handles.append(launch.launch_server(step_ms=env.step_ms, lease_s=env.lease_s, spare_pages=env.spare_pages,
                                              n_browsers=env.browsers))
        else:
          handles.append(launch.launch_server(launch.SERVER_MODULES[kind], step_ms=env.desktop_step_ms,
                                              lease_s=env.lease_s, max_sessions=env.desktop_sessions))
      print(f"[flywheel] sandbox servers: {', '.join(h.url for h in handles)}")
    return [h.url for h in handles]

  try:
    yield urls
  finally:
    for h in handles:
      h.stop()


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  if not workdir:
    raise app.UsageError("--workdir is required")
  std_logging.getLogger("httpx").setLevel(std_logging.WARNING)
  root = os.path.abspath(workdir)
  if _GENERATE.value is not None:
    generate_stage(config, root, _GENERATE.value, _POLICY.value)
    return
  fw = config.flywheel
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  spec = config_spec(config_flags.get_config_filename(flags.FLAGS["config"]))
  overrides = forwarded_overrides(sys.argv[1:])
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  # one compilation cache for every stage: same model and shapes, so later stages load compiled programs
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(root, "jax_cache"))
  tasks = list(config.tasks)
  init = os.path.abspath(fw.init) if fw.init else ""
  sets = fw_lib.set_dirs(root)
  t_start = time.time()

  def say(msg: str) -> None:
    print(f"[flywheel] {(time.time() - t_start) / 60:.1f} min: {msg}", flush=True)

  def stage(d: str, what: str, command) -> bool:
    """Runs the stage's command (`command()` -> argv; called only when the stage runs, so a finished one
    launches no sandbox) unless it finished (`run.is_done(d)`); True when it ran now."""
    if run_lib.is_done(d):
      say(f"{what}: finished before ({d})")
      return False
    say(what)
    os.makedirs(d, exist_ok=True)
    argv = command()
    t0 = time.time()
    try:
      rc = subprocess.run(argv, cwd=ROOT, env=env, timeout=fw.stage_timeout_min * 60).returncode
    except subprocess.TimeoutExpired:
      rc = 124
    if rc:
      raise SystemExit(f"[flywheel] stage failed (exit code {rc}): {what}\n  $ {' '.join(argv)}\n"
                       f"re-run the flywheel command to resume")
    if not run_lib.is_done(d):  # a trainer marks its own dir (done.json with its checkpoint)
      run_lib.mark_done(d, {"argv": argv, "minutes": (time.time() - t0) / 60})
    return True

  py, cfg = sys.executable, ["--config", spec, *overrides]

  def servers_flag() -> str:
    return f"--config.env.servers={_tuple(urls())}"

  def supervised(d: str, init_run: str, data, ct_data, ct_ratio: float, steps: int, lr: float) -> list[str]:
    """experiments/sft.py: SFT on `data` with `ct_ratio` of the batches from `ct_data` (CT), from `init_run`."""
    return [py, "-m", "experiments.sft", *cfg, "--workdir", d, *_init_flag(init_run),
            f"--config.sft.data={_tuple(data)}", f"--config.sft.ct_data={_tuple(ct_data)}",
            f"--config.sft.ct_ratio={ct_ratio}", f"--config.sft.steps={steps}", f"--config.sft.lr={lr}",
            "--config.sft.decay_steps=0"]

  rows: list[dict] = []
  with sandboxes(config.env) as urls:
    # ------------------------------------------------------------------------------------------------
    # Iteration 0: the initial policy, measured on the held-out seeds.
    # ------------------------------------------------------------------------------------------------
    if fw.eval_init and init:
      d = os.path.join(iter_dir(root, 0), "eval")
      stage(d, "iteration 0: held-out evaluation of the initial policy",
            lambda: _eval_argv(py, init, tasks, fw.eval_episodes, d, urls(), config.rollout.inference))
      rows.append({"iteration": 0, "policy": init, **_heldout(d)})

    prev = init
    for t in range(1, fw.iterations + 1):
      it = iter_dir(root, t)
      # ---------------------------------------------------------------------------------------------
      # Generate -> validate -> route.
      # ---------------------------------------------------------------------------------------------
      gen = os.path.join(it, "generate")
      stage(gen, f"iteration {t}: generate {fw.seeds_per_task * fw.samples_per_seed} samples per task of "
            f"{len(tasks)} tasks with {prev or 'the fresh init'}, validate, route",
            lambda: [py, "-m", "experiments.flywheel", *cfg, "--workdir", root, f"--generate={t}",
                     f"--policy={prev}", servers_flag()])
      # the sets as of this iteration (a re-run after later iterations takes the same decisions)
      sft_dirs = [*map(os.path.abspath, fw.sft_base), *([sets["sft"]] if fw_lib.dataset_size(sets["sft"], t) else [])]
      ct_dirs = [*map(os.path.abspath, fw.ct_base), *([sets["ct"]] if fw_lib.dataset_size(sets["ct"], t) else [])]
      cur, ran = prev, ["generate"]
      # ---------------------------------------------------------------------------------------------
      # CT (every ct_every-th iteration): the CT set mixed into the SFT set (CT alone while SFT is empty).
      # ---------------------------------------------------------------------------------------------
      if fw.ct_every and t % fw.ct_every == 0 and ct_dirs:
        d = os.path.join(it, "ct")
        ratio = fw.ct_ratio if sft_dirs else 1.0
        stage(d, f"iteration {t}: CT on {fw_lib.dataset_size(ct_dirs, t)} CT records mixed at ratio {ratio} into "
              f"{fw_lib.dataset_size(sft_dirs, t)} SFT records",
              lambda: supervised(d, cur, sft_dirs if ratio < 1 else (), ct_dirs, ratio, fw.ct_steps, fw.ct_lr))
        cur = d
        ran.append("ct")
      # ---------------------------------------------------------------------------------------------
      # SFT on the accumulated SFT set.
      # ---------------------------------------------------------------------------------------------
      if sft_dirs:
        d = os.path.join(it, "sft")
        stage(d, f"iteration {t}: SFT on {fw_lib.dataset_size(sft_dirs, t)} SFT records from "
              f"{cur or 'the fresh init'}", lambda: supervised(d, cur, sft_dirs, (), 0.0, fw.sft_steps, fw.sft_lr))
        cur = d
        ran.append("sft")
      else:
        say(f"iteration {t}: SFT skipped (the SFT set is empty: no sample has V = 1 yet)")
      # ---------------------------------------------------------------------------------------------
      # RL from the SFT weights (critic from value pretraining under them, when asked).
      # ---------------------------------------------------------------------------------------------
      critic = []
      if fw.value_pretrain and config.rl.algo == "ppo":
        d = os.path.join(it, "vpt")
        stage(d, f"iteration {t}: value pretraining under {cur or 'the fresh init'}",
              lambda: [py, "-m", "experiments.value_pretrain", *cfg, "--workdir", d,
                       *([f"--config.vpt.policy_run={cur}"] if cur else []), servers_flag()])
        critic = [f"--config.critic.init={os.path.join(d, 'critic')}"]
        ran.append("vpt")
      if fw.rl_iterations:
        d = os.path.join(it, "ppo")
        stage(d, f"iteration {t}: {config.rl.algo} from {cur or 'the fresh init'}, {fw.rl_iterations} iterations",
              lambda: [py, "-m", "experiments.train", *cfg, "--workdir", d, *_init_flag(cur), *critic,
                       f"--config.iterations={fw.rl_iterations}", f"--config.max_minutes={fw.rl_minutes}",
                       f"--config.env.train_seed_offset={(t - 1) * fw.rl_seed_stride}", servers_flag()])
        cur = d
        ran.append("ppo")
      # ---------------------------------------------------------------------------------------------
      # Held-out evaluation of the iteration's policy.
      # ---------------------------------------------------------------------------------------------
      d = os.path.join(it, "eval")
      if cur:
        stage(d, f"iteration {t}: held-out evaluation of {cur}",
              lambda: _eval_argv(py, cur, tasks, fw.eval_episodes, d, urls(), config.rollout.inference))
        ran.append("eval")
      with open(os.path.join(gen, "counts.json")) as f:
        counts = json.load(f)
      rows.append({"iteration": t, "policy": prev, "trained": cur, "stages": ran,
                   **{k: counts[k] for k in ("generated", "v1", "v0", "lost", "corrupt", "v1_fraction", "per_task")},
                   "sft_set": fw_lib.dataset_size(sft_dirs, t), "ct_set": fw_lib.dataset_size(ct_dirs, t),
                   "sft_generated": fw_lib.dataset_size(sets["sft"], t),
                   "ct_generated": fw_lib.dataset_size(sets["ct"], t), **(_heldout(d) if cur else {})})
      _write(root, rows, tasks, spec)
      print(format_table(rows, tasks), flush=True)
      prev = cur

  from experiments import plot
  png = plot.flywheel_plot(root)
  summary = ", ".join(f"{r['iteration']}: {pct(r.get('v1_fraction'))}" for r in rows if r["iteration"])
  say(f"done: {fw.iterations} iterations | V=1 fraction by iteration {summary} | table: "
      f"{os.path.join(root, 'flywheel.json')} | plot: {png} | policy: {prev} (checkpoints/) | sets: "
      f"{sets['sft']}, {sets['ct']}")


def _init_flag(run: str) -> list[str]:
  return [f"--config.policy.init={run}"] if run else []  # "" = the stage's fresh init of config.seed


def _eval_argv(py: str, run: str, tasks: list[str], episodes: int, d: str, urls: list[str],
               inference: str = "") -> list[str]:
  return [py, "-m", "experiments.eval", "--run", run, "--tasks", ",".join(tasks), "--episodes", str(episodes),
          "--json", os.path.join(d, "eval.json"), "--servers", ",".join(urls),
          *(["--inference", inference] if inference else [])]


def _heldout(d: str) -> dict:
  """{"heldout": {task: success}, "heldout_episodes": {task: n}} of an eval stage dir's eval.json."""
  with open(os.path.join(d, "eval.json")) as f:
    res = json.load(f)["results"]
  return {"heldout": {t: r["success"] for t, r in res.items()},
          "heldout_episodes": {t: r["episodes"] for t, r in res.items()}}


def _write(root: str, rows: list[dict], tasks: list[str], spec: str) -> None:
  write_json(os.path.join(root, "flywheel.json"), {"config": spec, "tasks": tasks, "rows": rows})


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
