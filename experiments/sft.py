r"""SFT trainer: cross-entropy on trajectory records (demonstrations, grounding examples), one linear
script like experiments/train.py. The grounding stage (CT-style, report 2.3) and SFT on demonstrations
(2.4) are this trainer with two configs (experiments/configs/miniwob_pipeline.py).

  python -m experiments.sft --config experiments/configs/miniwob_pipeline.py:grounding --workdir runs/x/grounding \
      --config.sft.data="('runs/x/grounding/data/train',)" --config.sft.heldout="('runs/x/grounding/data/heldout',)"
  python -m experiments.sft --config experiments/configs/miniwob_pipeline.py --workdir runs/x/sft \
      --config.policy.init=runs/x/grounding --config.sft.data="('runs/x/demos','runs/x/grounding/data/train')"
  python -m experiments.sft --config experiments/configs/miniwob_pipeline.py:+smoke ...   # tiny, for tests

Re-running the same command resumes from the last complete checkpoint in `--workdir`, with the data
iterator where it was (its grain state is in the checkpoint). The checkpoint holds the full train
state of `state.Parts.init_state` (policy trained, critic untouched), so experiments/eval.py,
`--config.policy.init=<this workdir>` (PPO, value pretraining) and the next SFT stage read it as they
read a PPO run. Every `sft.eval_every` steps: held-out loss on `sft.heldout` records (grounding
accuracy of the policy's own sampled clicks / answers on held-out grounding examples) and the success
of the policy's own actions on `sft.eval_episodes` held-out seeds of each task in `config.tasks`.
The budget is `sft.steps` updates; `sft.max_minutes` only guards a process against a hung or far too
slow host (evaluations not counted): it checkpoints and stops the stage with a non-zero exit naming the
step reached (tars_jax/train/guard.py), and the same command continues from there.

Continual pre-training (report 2.3, the data flywheel's CT set of rejected trajectories):
`sft.ct_data` names CT record dirs and `sft.ct_ratio` the fraction of batches drawn from them. A CT
batch is trained by next-token loss on every text token of its trajectories, observations included,
screenshots as context (tars_jax/train/ct.py), an SFT batch as above; the two sets are separate
shuffled, length-bucketed streams interleaved batch by batch (each batch all SFT or all CT, so each
keeps its length buckets and its own jitted update), in a fixed order (data/pipeline.py `mix`) whose
position is in the checkpoint with both streams' states. `ct_ratio=1.0` with `data` empty is a CT-only
run. Metrics: `train/ct_ce` (per CT text token) beside `train/ce` (per SFT reply token); a log row
holds the latest step of each kind since the previous row.

  python -m experiments.sft --config experiments/configs/miniwob_pipeline.py --workdir runs/x/ct \
      --config.policy.init=runs/x/ppo --config.sft.data="('runs/x/demos',)" \
      --config.sft.ct_data="('runs/x/flywheel/ct',)" --config.sft.ct_ratio=0.25

Layout of the run dir: config.json, metrics.jsonl, tensorboard/, checkpoints/, sft.json (summary).
"""

from __future__ import annotations

import functools
import time

from absl import app, flags
from ml_collections import config_flags

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from tars_jax.agent.trajectory import real_rows
from tars_jax.analysis.image_dependence import image_dependence
from tars_jax.data import pipeline, records
from tars_jax.data.sources import grounding
from tars_jax.rollout import evaluation
from tars_jax.train import checkpoint as ckpt
from tars_jax.train import ct, sft
from tars_jax.train import guard as guard_lib
from tars_jax.train import run as run_lib
from tars_jax.train import state as state_lib
from tars_jax.train.metrics import episode_metrics

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created; resumed if it has checkpoints).")


def check_data_settings(s) -> None:
  """Refuses a contradictory SFT / CT data mix of `config.sft` before anything starts: app.UsageError
  naming the fields (ct_ratio outside [0, 1], ct_data without ct_ratio or the reverse, data that
  ct_ratio 1 would never read, no data at all)."""
  if not 0.0 <= s.ct_ratio <= 1.0:
    raise app.UsageError(f"config.sft.ct_ratio={s.ct_ratio}: the fraction of batches from ct_data, in [0, 1]")
  if s.ct_data and s.ct_ratio == 0:
    raise app.UsageError("config.sft.ct_data is set but config.sft.ct_ratio is 0: give the fraction of batches "
                         "to draw from it, e.g. --config.sft.ct_ratio=0.25")
  if s.ct_ratio > 0 and not s.ct_data:
    raise app.UsageError(f"config.sft.ct_ratio={s.ct_ratio} but config.sft.ct_data is empty: name the CT record "
                         "dirs, e.g. --config.sft.ct_data=\"('runs/x/ct',)\"")
  if s.ct_ratio == 1 and s.data:
    raise app.UsageError("config.sft.ct_ratio=1.0 draws every batch from config.sft.ct_data: config.sft.data would "
                         "never be read; leave it empty for a CT-only run, or lower ct_ratio")
  if s.ct_ratio < 1 and not s.data:
    raise app.UsageError("config.sft.data is empty: name the record dirs to train on, e.g. "
                         "--config.sft.data=\"('runs/x/demos',)\" (or set ct_ratio=1.0 for a CT-only run)")


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  s = config.sft
  check_data_settings(s)
  run = run_lib.start("sft", config, workdir, budget=s.steps, unit="step", max_minutes=s.max_minutes,
                      keep_checkpoints=config.keep_checkpoints)
  guard = run.guard  # evaluations not counted against it
  if run.previous_budget is not None and not s.decay_steps:
    # the cosine spans sft.steps: rebuilt over the new count, it differs from a run started with it
    # (benchmarks/RESULTS.md, "The multi-turn suite's SFT start")
    print(f"[sft] the learning-rate cosine now spans {s.steps} updates, not {run.previous_budget}: from the update "
          f"this run resumes at it differs from a run started with sft.steps={s.steps}", flush=True)

  # ----------------------------------------------------------------------------------------------
  # Model, optimiser, data (checked against the model before any step), resume.
  # ----------------------------------------------------------------------------------------------
  parts = state_lib.build(config)
  tok = parts.tokenizer
  for dirs in (s.data, s.ct_data, s.heldout):  # mismatched or empty data fails here, before any init or step
    if dirs:
      sft.check_data(dirs, image_hw=parts.image_hw, n_img_tokens=parts.loop_cfg.n_img_tokens, tokenizer=tok)
  r = config.rl
  opt = sft.make_optimizer(s.lr, s.warmup_steps, s.decay_steps or s.steps, s.final_lr_fraction, r.max_grad_norm,
                           r.weight_decay)
  state, src = state_lib.start_policy(parts.init_state(config.seed), config.policy.init, opt)
  if src:
    print(f"[sft] policy initialised from {src}")
  prep = functools.partial(sft.prepare, grammar=parts.grammar, tokenizer=tok, thoughts=s.thoughts)
  coll_kw = dict(pad_id=tok.pad_id, image_hw=parts.image_hw, length_multiple=config.length_multiple,
                 batch_size=s.batch_size)
  coll = functools.partial(sft.collate_demos, prep=prep, **coll_kw)
  corrupt = records.CorruptCounter()
  # Per source, once: how its episodes become a batch and the update that trains on it (SFT: reply
  # tokens under the grammar; CT: every text token, full softmax: tars_jax/train/ct.py).
  collate_fns = {"sft": coll, "ct": functools.partial(_ct_collate, prep=functools.partial(ct.prepare, tokenizer=tok),
                                                      image_id=parts.inputs.image_token_id, **coll_kw)}
  steps = {"sft": functools.partial(sft.train_step, table=parts.table, graphdef=parts.policy_gd, opt=opt,
                                    inputs=parts.inputs, aux_coef=r.aux_loss_coef),
           "ct": functools.partial(ct.train_step, graphdef=parts.policy_gd, opt=opt, inputs=parts.inputs,
                                   aux_coef=r.aux_loss_coef)}
  set_dirs, weights = {"sft": s.data, "ct": s.ct_data}, {"sft": 1.0 - s.ct_ratio, "ct": s.ct_ratio}
  # each set its own shuffled, length-bucketed stream (seeds config.seed, + 1), interleaved at ct_ratio
  streams = {name: pipeline.batches(
      records.episodes(tuple(set_dirs[name]), skip_corrupt=s.skip_corrupt, counter=corrupt), seed=config.seed + k,
      batch_size=s.batch_size, collate_fn=collate_fns[name], shuffle=True, process_index=jax.process_index(),
      process_count=jax.process_count(), length_multiple=config.length_multiple)
      for k, name in enumerate(set_dirs) if weights[name] > 0}
  train_ds = pipeline.mix(streams, {name: weights[name] for name in streams})  # (source name, batch) pairs
  heldout_pairs = [pair for d in s.heldout for pair in records.read_episodes(d)]  # (episode, provenance)
  # a fixed sample of `eval_examples` over all held-out tasks (the sets are written task by task)
  pick = np.random.default_rng(0).permutation(len(heldout_pairs))[: s.eval_examples]
  heldout_pairs = [heldout_pairs[i] for i in sorted(pick)]
  heldout = [e for e, _ in heldout_pairs]
  ground = [pair for pair in heldout_pairs if pair[1]["source"] == "grounding"]
  heldout_batches = [coll(heldout[i:i + s.batch_size]) for i in range(0, len(heldout), s.batch_size)]
  data_iter = iter(train_ds)

  state, start, meta = run.resume(state)
  mngr = run.mngr
  if start:
    data_iter.set_state(meta["data_state"])
  writer = run.writer(config, start)
  ct_note = f" | CT ({s.ct_ratio:.0%} of batches): {', '.join(s.ct_data)}" if s.ct_data else ""
  print(f"[sft] MoE: {nnx.merge(parts.policy_gd, state['policy']).moe_strategy_summary()} | data: "
        f"{', '.join(s.data) or '-'}{ct_note} | held-out: {len(heldout)} episodes | thoughts: {s.thoughts}")
  eval_fn = functools.partial(sft.eval_metrics, graphdef=parts.policy_gd, inputs=parts.inputs)

  def evaluate(params, step: int) -> dict[str, float]:
    t0 = time.time()
    m: dict[str, float] = {}
    if heldout_batches:
      rows = [jax.device_get(eval_fn(params, b, parts.table)) for b in heldout_batches]
      w = np.array([x["tokens"] for x in rows])
      for k in ("ce", "ce_free", "acc_free"):
        m[f"heldout/{k}"] = float(np.average([x[k] for x in rows], weights=w))
      n = min(len(heldout), s.batch_size)
      if n > 1:  # how much the decisions depend on the screenshot, per layer (issue #25 item 7)
        dep = image_dependence(parts.policy_gd, params, real_rows(heldout_batches[0], n), parts.table,
                               temperature=config.sampling.temperature,
                               image_token_id=parts.inputs.image_token_id, grid_hw=parts.inputs.grid_hw)
        m.update({f"image_dependence/{k}": v for k, v in dep.items() if k not in ("embed", "decisions")})
      if ground:  # the policy's own sampled clicks / answers on held-out grounding examples
        pol = parts.batched_policy(params, batch_size=config.env.num_sessions, seed=config.seed + 7)
        m.update({f"grounding/{k}": float(v) for k, v in grounding.grounding_accuracy(pol.act, ground).items()})
    if s.eval_episodes:  # its own sampling stream: the result does not depend on the grounding eval
      pol = parts.batched_policy(params, batch_size=config.env.num_sessions, seed=config.seed + 7)
      from envs_bridge.launch import env_fleet  # a sandbox only when success is measured
      with env_fleet(config.env) as (loop, clients):
        t_play = time.perf_counter()
        ev = evaluation.play(loop, pol.act, clients,
                             evaluation.eval_jobs(list(config.tasks), s.eval_episodes, config.env.eval_seed_offset),
                             parts.eval_loop_cfg, tok, sessions=config.env.num_sessions, version=step)
        m["perf/eval_episodes_s"] = time.perf_counter() - t_play
      m.update(evaluation.metrics(evaluation.summarize(ev)))
      done = [e for e in ev if not e.lost]  # what the policy writes: think length (thoughts variant)
      if done:
        m["eval/think_tokens"] = episode_metrics(done, list(config.tasks), tok, parts.table)["think_tokens"]
    guard.exclude(time.time() - t0)
    return m

  # ----------------------------------------------------------------------------------------------
  # Training loop.
  # ----------------------------------------------------------------------------------------------
  t_start, step, last = time.time(), start, {}

  log_step, t_log = start, time.perf_counter()
  window: dict[str, dict] = {}  # source -> metrics of its latest step since the last log row
  params, opt_state = state["policy"], state["policy_opt"]
  bar = tqdm(total=s.steps, initial=start, desc="sft", unit="step", dynamic_ncols=True)
  try:
    if start == 0 and s.eval_every and not config.policy.init:
      # the starting policy, for the before / after comparison (a policy.init run was measured at the
      # end of the run it comes from)
      writer.write(0, evaluate(params, 0))
    tripped = False
    while step < s.steps:
      if guard.tripped():
        tripped = True
        break
      source, batch = next(data_iter)
      params, opt_state, window[source] = steps[source](params, opt_state, batch)
      step += 1
      if step % s.log_every == 0 or step == s.steps:
        m = {f"train/{k}": float(v) for sm in jax.device_get(list(window.values())) for k, v in sm.items()}
        window = {}
        # over the steps since the last log (a step's own time is hidden by jax's async dispatch)
        m["perf/examples_per_s"] = s.batch_size * (step - log_step) / max(time.perf_counter() - t_log, 1e-9)
        m["perf/wall_min"] = (time.time() - t_start) / 60
        m["data/corrupt_skipped"] = corrupt.count
        if s.eval_every and step % s.eval_every == 0:
          m.update(evaluate(params, step))
        writer.write(step, m)
        last = m
        log_step, t_log = step, time.perf_counter()  # evaluation time not counted as training
        bar.set_postfix({k: f"{m['train/' + k]:.3f}" for k in ("ce", "acc_free", "ct_ce") if "train/" + k in m})
      if step % s.ckpt_every == 0:
        ckpt.save(mngr, step, dict(state, policy=params, policy_opt=opt_state),
                  {"iteration": step, "data_state": data_iter.get_state(), "minutes": guard.minutes()})
      bar.update(1)
    if step > start:
      ckpt.save_at_stop(mngr, step, dict(state, policy=params, policy_opt=opt_state),
                        {"iteration": step, "data_state": data_iter.get_state(), "minutes": guard.minutes()})
    if tripped:
      raise guard.error(step)
    if s.eval_every and step % s.eval_every and step > start:  # the final policy, measured once more
      last = evaluate(params, step)
      writer.write(step, last)
  finally:
    bar.close()
    writer.close()
  summary = {"steps": step, "minutes": (time.time() - t_start) / 60, "final": last,
             "checkpoint": f"{mngr.directory}/{mngr.latest_step()}"}
  run.finish(summary)  # sft.json, done.json
  print(f"[sft] done: {step} steps in {summary['minutes']:.1f} min | checkpoints: {mngr.directory} "
        f"(latest {mngr.latest_step()}) | metrics: {writer.path} | tensorboard --logdir {writer.tb_dir} | "
        f"use --config.policy.init={workdir}")


def _ct_collate(episodes, *, image_id, **kw) -> dict:
  """A CT batch: `sft.collate_demos` (with `ct.prepare` as `prep`) plus `text_mask`, the all-text loss mask."""
  return ct.with_text_mask(sft.collate_demos(episodes, **kw), image_id)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(guard_lib.exit_on_trip(main))
