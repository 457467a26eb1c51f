r"""ORM trainer: the policy's model learns to answer "Did the agent complete the task? yes / no" on
verifier-labelled trajectory records (UI-TARS-2 report sections 2.5.2 and 3.3; tars_jax/train/orm.py),
one linear script like experiments/sft.py.

  python -m experiments.orm --config experiments/configs/orm.py --workdir runs/orm/orm \
      --config.orm.data="('runs/orm/ppo_verifier/rollouts','runs/main/ppo/rollouts','runs/main/demos')"
  python -m experiments.orm --config experiments/configs/orm.py:+smoke --workdir /tmp/orm \
      --config.orm.data="('/tmp/records',)"       # tiny, for tests

Data: every non-lost episode of `orm.data` (rollouts of PPO runs, `experiments/train.py` writes them
to `<run>/rollouts`; demonstrations) with its verifier label (`orm.verifier_label`: done with a
positive environment return, or the record's provenance `extra["success"]`). Held out: the records of
`orm.heldout`, or (when empty) the episodes of a fixed `orm.heldout_fraction` of the (task, seed)
groups of `orm.data` (a group = one screen: GRPO's episodes of a screen, and runs sharing training
seeds, stay on one side). `orm.balance = "length"` then subsamples each side alone so that within each
(task, number of turns) stratum successes and failures are equally many (`orm.balance_by_length`, seeded
by `seed`): the episode's length no longer gives its label away ("none": every episode kept).
Classes are balanced by sampling: every batch holds batch_size / 2
successes and failures drawn at random (with replacement) from the training episodes, from the key
(seed, step), so a resumed run draws what an uninterrupted one would have.

Loss: cross-entropy of the answer tokens (`yes` / `no` and EOS) over the whole vocabulary
(`train.sft.train_step` without a grammar table: the answer is text, not an action). The score is
P(yes) renormalised over the answers' first tokens (`orm.OrmScorer`).

Every `orm.eval_every` steps and at the end: the held-out episodes (a fixed sample of
`orm.eval_examples`) scored, precision / recall / F1 / false-positive rate at threshold 0.5 and
AUROC in metrics.jsonl (`heldout/*`); at the end the table (all held-out, per task, per source, and
a sample of the training episodes) is printed and written to `orm.json`, with 95 % bootstrap intervals
of the held-out rows (`orm.bootstrap_reps` replicates; (task, seed) groups resampled whole within each
task) and the length-only baseline (the turn count as the score: AUROC 0.5 = no length shortcut).
Re-running the same command resumes from the last complete checkpoint in `--workdir`. The checkpoint
is a full train state (as SFT's), so `OrmScorer.from_run(workdir)` and `--config.policy.init` read it.
Layout of the run dir: config.json, metrics.jsonl, tensorboard/, checkpoints/, orm.json.
"""

from __future__ import annotations

import functools
import os
import time
import zlib

from absl import app, flags
from ml_collections import config_flags

import jax
import numpy as np
from tqdm import tqdm

from tars_jax.data import records
from tars_jax.train import orm as orm_lib
from tars_jax.train import checkpoint as ckpt
from tars_jax.train import guard as guard_lib
from tars_jax.train import run as run_lib
from tars_jax.train import sft
from tars_jax.train import state as state_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created; resumed if it has checkpoints).")


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  o = config.orm
  if not o.data:
    raise app.UsageError("config.orm.data is empty: name the record dirs of labelled trajectories, e.g. "
                         "--config.orm.data=\"('runs/x/ppo/rollouts','runs/x/demos')\"")
  run = run_lib.start("orm", config, workdir, budget=o.steps, unit="step", max_minutes=o.max_minutes,
                      keep_checkpoints=config.keep_checkpoints)
  guard = run.guard  # evaluations not counted against it

  # ----------------------------------------------------------------------------------------------
  # Model, optimiser, labelled data (checked against the model before any step), resume.
  # ----------------------------------------------------------------------------------------------
  parts = state_lib.build(config)
  r = config.rl
  opt = sft.make_optimizer(o.lr, o.warmup_steps, o.steps, o.final_lr_fraction, r.max_grad_norm, r.weight_decay)
  state, src = state_lib.start_policy(parts.init_state(config.seed), config.policy.init, opt)
  if src:
    print(f"[orm] initialised from {src}")
  tok = parts.tokenizer
  for dirs in (o.data, o.heldout):  # mismatched or empty data fails here, before any step
    if dirs:
      sft.check_data(dirs, image_hw=parts.image_hw, n_img_tokens=parts.loop_cfg.n_img_tokens, tokenizer=tok)
  settings = orm_lib.settings_from_config(o)
  scorer = orm_lib.OrmScorer.from_parts(parts, state["policy"], settings, batch_size=o.batch_size)
  yes_ids, no_ids = orm_lib.answer_ids(tok, settings)

  data = records.episodes(tuple(o.data))
  items = _labelled(data, "data")
  if o.heldout:
    held_ds = records.episodes(tuple(o.heldout))
    train, held = items, _labelled(held_ds, "heldout")
  else:  # a fixed fraction of the (task, seed) groups of the data
    held_ds = data
    out = [x for x in items if _group_hash(x) < o.heldout_fraction]
    train, held = [x for x in items if _group_hash(x) >= o.heldout_fraction], out
  before = {"train": _per_task(train), "heldout": _per_task(held)}
  if o.balance == "length":  # each side alone: the label independent of (task, turns) on both
    train, held = orm_lib.balance_by_length(train, config.seed), orm_lib.balance_by_length(held, config.seed + 1)
  elif o.balance != "none":
    raise ValueError(f"orm.balance={o.balance!r}; expected one of {orm_lib.BALANCE}")
  pos = np.array([x["i"] for x in train if x["label"]], np.int64)
  neg = np.array([x["i"] for x in train if not x["label"]], np.int64)
  if not len(pos) or not len(neg):
    raise ValueError(f"the training episodes of {list(o.data)} hold {len(pos)} successes and {len(neg)} failures: "
                     "an ORM needs both (add rollouts with failures, or demonstrations as successes)")
  pick = np.random.default_rng(0).permutation(len(held))[: o.eval_examples]
  held = [held[i] for i in sorted(pick)]
  pick = np.random.default_rng(1).permutation(len(train))[: o.eval_examples]
  train_sample = [train[i] for i in sorted(pick)]
  counts = {"train": {"episodes": len(train), "successes": int(len(pos))},
            "heldout": {"episodes": len(held), "successes": sum(x["label"] for x in held)},
            "balance": o.balance, "before_balance": before,
            "per_task": {"train": _per_task(train), "heldout": _per_task(held)}}

  state, start, _ = run.resume(state)
  mngr = run.mngr
  writer = run.writer(config, start)
  print(f"[orm] data: {', '.join(o.data)} | train: {counts['train']['episodes']} episodes "
        f"({counts['train']['successes']} successes, balanced by sampling) | held-out: "
        f"{counts['heldout']['episodes']} ({counts['heldout']['successes']} successes) | balance {o.balance} | "
        f"last {settings.screenshots} screenshots, budget {settings.max_tokens or 'none'} tokens")
  step_fn = functools.partial(sft.train_step, graphdef=parts.policy_gd, opt=opt, inputs=parts.inputs,
                              aux_coef=r.aux_loss_coef)

  def make_batch(step: int) -> tuple[dict, dict]:
    """The balanced batch of `step` (from the key (seed, step)) and what its prompts left out."""
    rng = np.random.default_rng([config.seed, step])
    half = o.batch_size // 2
    idx = np.concatenate([rng.choice(pos, half), rng.choice(neg, o.batch_size - half)])
    labels = np.arange(o.batch_size) < half
    order = rng.permutation(o.batch_size)
    eps = [data[int(i)][0] for i in idx[order]]
    ps = scorer.prompts(eps)
    batch, _ = orm_lib.collate(ps, [yes_ids if y else no_ids for y in labels[order]], pad_id=tok.pad_id,
                               max_images=orm_lib.image_slots(ps, settings.screenshots), image_hw=parts.image_hw,
                               length_multiple=config.length_multiple, batch_size=o.batch_size)
    dropped = {k: sum(p.dropped[k] for p in ps) for k in ("screenshots", "turns", "instruction_chars")}
    return batch, dropped

  def score(params, sample, ds) -> np.ndarray:
    scorer.params = params
    return np.concatenate([scorer.p_yes([ds[x["i"]][0] for x in sample[i:i + 64]])
                           for i in range(0, len(sample), 64)] or [np.zeros(0, np.float32)])

  def evaluate(params, full: bool) -> dict[str, dict]:
    """{row name: classification_metrics}: 'heldout' (and with full: per task, per source, 'train';
    the held-out scores are kept in `final_scores` for `intervals`)."""
    t0 = time.time()
    rows = {}
    if held:
      p = score(params, held, held_ds)
      y = np.array([x["label"] for x in held], bool)
      rows["heldout"] = orm_lib.classification_metrics(p, y)
      if full:
        final_scores["p_yes"] = p
        for key in ("task", "source"):
          for v in sorted({x[key] for x in held}):
            sel = np.array([x[key] == v for x in held])
            rows[f"heldout {key}={v}"] = orm_lib.classification_metrics(p[sel], y[sel])
    if full:
      rows["train (sample)"] = orm_lib.classification_metrics(score(params, train_sample, data),
                                                               [x["label"] for x in train_sample])
    guard.exclude(time.time() - t0)
    return rows

  def intervals(p: np.ndarray) -> tuple[dict[str, dict], dict[str, dict]]:
    """Bootstrap intervals of the held-out rows (the ORM's, and the length-only baseline's), resampling
    (task, seed) groups whole within each task: ({row: {metric: (lo, hi)}}, {row: metrics} of the
    baseline, which scores an episode -turns, so fewer turns = success; AUROC is its only meaningful
    column)."""
    y = np.array([x["label"] for x in held], bool)
    task = np.array([x["task"] for x in held])
    group = np.array([f"{x['task']}/{x['seed']}" for x in held])
    length = -np.array([x["turns"] for x in held], np.float64)
    cis, base = {}, {}
    for name, sel in [("heldout", np.ones(len(held), bool))] + [(f"heldout task={v}", task == v)
                                                               for v in sorted(set(task))]:
      cis[name] = orm_lib.bootstrap_intervals(p[sel], y[sel], strata=task[sel], groups=group[sel],
                                              reps=o.bootstrap_reps, seed=config.seed)
      base[name] = orm_lib.classification_metrics(length[sel], y[sel])
      cis[f"length baseline: {name}"] = orm_lib.bootstrap_intervals(
          length[sel], y[sel], strata=task[sel], groups=group[sel], reps=o.bootstrap_reps, seed=config.seed)
    return cis, base

  def flat(m: dict, prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in m.items() if v is not None}

  # ----------------------------------------------------------------------------------------------
  # Training loop.
  # ----------------------------------------------------------------------------------------------
  t_start, step, last = time.time(), start, {}


  log_step, t_log = start, time.perf_counter()
  params, opt_state = state["policy"], state["policy_opt"]
  bar = tqdm(total=o.steps, initial=start, desc="orm", unit="step", dynamic_ncols=True)
  rows: dict = {}
  final_scores: dict = {}
  try:
    if start == 0 and o.eval_every and held:  # the starting model, for the before / after comparison
      writer.write(0, flat(evaluate(params, full=False)["heldout"], "heldout"))
    tripped = False
    while step < o.steps:
      if guard.tripped():
        tripped = True
        break
      batch, dropped = make_batch(step)
      params, opt_state, m = step_fn(params, opt_state, batch, None)
      step += 1
      if step % o.log_every == 0 or step == o.steps:
        m = jax.device_get(m)
        m = {"train/ce": float(m["ce"]), "train/acc": float(m["acc_free"]), "train/answer_tokens": float(m["tokens"]),
             "train/loss": float(m["loss"]), "train/grad_norm": float(m["grad_norm"]), "train/aux": float(m["aux"])}
        m.update({f"data/dropped_{k}": v for k, v in dropped.items()})
        m["perf/examples_per_s"] = o.batch_size * (step - log_step) / max(time.perf_counter() - t_log, 1e-9)
        m["perf/wall_min"] = (time.time() - t_start) / 60
        if o.eval_every and step % o.eval_every == 0 and held:
          m.update(flat(evaluate(params, full=False)["heldout"], "heldout"))
        writer.write(step, m)
        last = m
        log_step, t_log = step, time.perf_counter()
        bar.set_postfix(ce=f"{m['train/ce']:.3f}", f1=f"{m.get('heldout/f1', float('nan')):.2f}")
      if step % o.ckpt_every == 0:
        ckpt.save(mngr, step, dict(state, policy=params, policy_opt=opt_state),
                  {"iteration": step, "minutes": guard.minutes()})
      bar.update(1)
    if step > start:
      ckpt.save_at_stop(mngr, step, dict(state, policy=params, policy_opt=opt_state),
                        {"iteration": step, "minutes": guard.minutes()})
    if tripped:
      raise guard.error(step)
    rows = evaluate(params, full=True)  # the final model, on every held-out episode of the sample
    if "heldout" in rows and step > start:  # (a re-run of a finished run only prints the table again)
      writer.write(step, flat(rows["heldout"], "heldout"))
  finally:
    bar.close()
    writer.close()
  print(f"[orm] step {step}: P(yes) > 0.5 = success; F1, precision, recall, FPR, accuracy in %")
  print(orm_lib.format_table(rows))
  cis, base = {}, {}
  if "p_yes" in final_scores and o.bootstrap_reps:
    cis, base = intervals(final_scores["p_yes"])
    both = dict(rows, **{f"length baseline: {k}": v for k, v in base.items()})
    print(f"[orm] 95 % bootstrap intervals ({o.bootstrap_reps} replicates; (task, seed) groups resampled whole "
          f"within each task); length baseline = the turn count alone (score -turns; AUROC 0.5 = no shortcut)")
    print(orm_lib.format_interval_table(both, cis))
  summary = {"steps": step, "minutes": (time.time() - t_start) / 60, "threshold": 0.5, "data": counts,
             "settings": {"screenshots": settings.screenshots, "max_tokens": settings.max_tokens,
                          "question": settings.question, "answers": list(settings.answers),
                          "thoughts": settings.thoughts},
             "metrics": rows, "length_baseline": base, "intervals": cis, "bootstrap_reps": o.bootstrap_reps,
             "final_train": last, "checkpoint": f"{mngr.directory}/{mngr.latest_step()}"}
  run.finish(summary)  # orm.json, done.json
  h = rows.get("heldout", {})
  print(f"[orm] done: {step} steps in {summary['minutes']:.1f} min | held-out F1 {100 * h.get('f1', 0):.1f} "
        f"FPR {100 * h.get('false_positive_rate', 0):.1f} | checkpoints: {mngr.directory} (latest "
        f"{mngr.latest_step()}) | metrics: {writer.path} | table: {os.path.join(workdir, 'orm.json')} | "
        f"use --config.rl.orm_run={workdir}")


def _labelled(ds, what: str) -> list[dict]:
  """One pass over a records dataset: [{"i": index, "label", "task", "seed", "source", "turns"}] of its
  episodes that were not lost (decodes every record once; the screenshots are not kept)."""
  out = []
  for i in tqdm(range(len(ds)), desc=f"labels ({what})", unit="ep", dynamic_ncols=True, leave=False):
    ep, prov = ds[i]
    if not ep.lost:
      out.append({"i": i, "label": orm_lib.verifier_label(ep, prov), "task": ep.task, "seed": int(ep.seed),
                  "source": prov["source"], "turns": len(ep.turns)})
  return out


def _per_task(items: list[dict]) -> dict[str, dict[str, int]]:
  """{task: {"successes", "failures"}} of labelled items."""
  out: dict[str, dict[str, int]] = {}
  for x in items:
    d = out.setdefault(x["task"], {"successes": 0, "failures": 0})
    d["successes" if x["label"] else "failures"] += 1
  return dict(sorted(out.items()))


def _group_hash(x: dict) -> float:
  """A fixed number in [0, 1) per (task, seed) group (the held-out split)."""
  return zlib.crc32(f"{x['task']}/{x['seed']}".encode()) / 2 ** 32


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(guard_lib.exit_on_trip(main))
