r"""Supervised pointing probe: how many SFT updates does a model need to point at the right button?

An upper bound on what demonstrations teach per update (README, "Main job"; measured runs in
benchmarks/RESULTS.md, issue #25): the SFT stage's loss, optimiser and jitted update
(`tars_jax/train/sft.py`) on replies `click(start_box='(x,y)')` whose (x, y) is the grid point
nearest the centre of the correct button (labelled as the grounding examples are), read from the DOM
through the sandbox's debug endpoint (never shown to agents). At each of `--eval_at` it prints, per
task, the hit rate of the policy's own sampled clicks (temperature of the config) on held-out screens
and, for click-test-2, how often it hit the other button instead (the policy found *a* button but not
the one named).

Two steps, so the training step runs where the sandbox is not (e.g. a GPU machine):

  # 1. screens + button boxes from the real sandbox (Chromium), saved as PNGs in one .npz
  python -m benchmarks.probes.pointing_probe --collect /tmp/screens.npz --train_screens 4000 --test_screens 200
  # 2. train and evaluate on them; model fields not in the config are set with --set
  python -m benchmarks.probes.pointing_probe --screens /tmp/screens.npz \
      --config experiments/configs/miniwob_pipeline.py --steps 3000 --eval_at 500,1000,2000,3000 \
      [--config.model.vision_depth=4] [--set spatial_merge_size=1] [--json out.json]
      [--init runs/main/grounding] [--max_train_screens miniwob/click-test-2=1500]
"""

from __future__ import annotations

import ast
import json
import time

from absl import app, flags
from ml_collections import config_flags

import jax
import numpy as np

from benchmarks.probes.pointing_data import collect, episode, hit, load
from tars_jax.agent.trajectory import collate
from tars_jax.data.sources import grounding
from tars_jax.train import sft
from tars_jax.train.state import build, load_policy

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config (its model, grammar, SFT lr).")
_COLLECT = flags.DEFINE_string("collect", None, "Collect screens from the sandbox into this .npz and exit.")
_SCREENS = flags.DEFINE_list("screens", None, "Train and evaluate on the screens of these .npz files.")
_TRAIN = flags.DEFINE_integer("train_screens", 4000, "--collect: training screens per task.")
_TEST = flags.DEFINE_integer("test_screens", 200, "--collect: held-out screens per task.")
_TASKS = flags.DEFINE_list("tasks", ["miniwob/click-test", "miniwob/click-test-2"], "--collect: tasks.")
_TRAIN_TASKS = flags.DEFINE_list("train_tasks", None, "Tasks trained on (default: all in the file).")
_STEPS = flags.DEFINE_integer("steps", 3000, "Updates (the cosine schedule's length).")
_BATCH = flags.DEFINE_integer("batch", None, "Screens per update (default: config.sft.batch_size).")
_LR = flags.DEFINE_float("lr", None, "Peak learning rate (default: config.sft.lr).")
_EVAL_AT = flags.DEFINE_list("eval_at", ["500", "1000", "2000", "3000"], "Updates after which to evaluate.")
_MAX_SECONDS = flags.DEFINE_float("max_seconds", 0.0, "Stop (after an evaluation) past this many seconds; 0 = no limit.")
_INIT = flags.DEFINE_string("init", None, "Start from this run's policy (a run dir or <run>/checkpoints/<step>, "
                            "e.g. the grounding stage) instead of a fresh init.")
_MAX_TRAIN = flags.DEFINE_list("max_train_screens", [], "task=N: train on the task's first N screens of the "
                               "files only (e.g. miniwob/click-test-2=1500); other tasks: all.")
_SET = flags.DEFINE_multi_string("set", [], "key=value model fields (Python literals), e.g. spatial_merge_size=1.")
_LABEL = flags.DEFINE_string("label", None, "Name of this variant in the output (default: the --set values).")
_JSON = flags.DEFINE_string("json", None, "Append the results as one JSON line to this file.")

def main(argv):
  del argv
  if _COLLECT.value:
    collect(_COLLECT.value, _TASKS.value, _TRAIN.value, _TEST.value)
    return
  config = _CONFIG.value
  with config.model.unlocked():
    for kv in _SET.value:
      k, v = kv.split("=", 1)
      config.model[k] = ast.literal_eval(v)
  parts = build(config)
  tok, s = parts.tokenizer, config.sft
  batch, lr = _BATCH.value or s.batch_size, _LR.value or s.lr
  screens = [r for path in _SCREENS.value for r in load(path, parts.image_hw)]
  train_tasks = set(_TRAIN_TASKS.value or {r["task"] for r in screens})
  train = [r for r in screens if r["split"] == "train" and r["task"] in train_tasks]
  cap = {t: int(n) for t, n in (kv.rsplit("=", 1) for kv in _MAX_TRAIN.value)}
  train = [r for t in sorted(train_tasks) for r in [x for x in train if x["task"] == t][:cap.get(t)]]
  test = [r for r in screens if r["split"] == "test"]

  fmt = grounding.EpisodeFormat.from_parts(parts)
  eps = [episode(fmt, r) for r in train]
  test_eps = [episode(fmt, r) for r in test]  # evaluation prompts: prefix + first observation
  opt = sft.make_optimizer(lr, s.warmup_steps, _STEPS.value, s.final_lr_fraction, config.rl.max_grad_norm,
                           config.rl.weight_decay)
  state = parts.init_state(config.seed)
  if _INIT.value:
    state, src = load_policy(state, _INIT.value, opt)
    print(f"[probe] policy from {src}", flush=True)
  params = state["policy"]
  opt_state = opt.init(params)

  def evaluate(p) -> dict:
    pol = parts.batched_policy(p, batch_size=50, seed=1)
    res = {}
    for task in sorted({r["task"] for r in test}):
      pairs = [(r, e) for r, e in zip(test, test_eps) if r["task"] == task]
      recs = [r for r, _ in pairs]
      outs = pol.act([list(e.prefix_ids) + list(e.turns[0].obs_ids) for _, e in pairs], [[r["image"]] for r in recs])
      texts = [tok.decode(ids) for ids, *_ in outs]
      res[task] = {"hit": float(np.mean([hit(t, r["box"], r["hw"]) for t, r in zip(texts, recs)])),
                   "other": float(np.mean([hit(t, r["other"], r["hw"]) and not hit(t, r["box"], r["hw"])
                                           for t, r in zip(texts, recs)]))}
    return res

  label = _LABEL.value or " ".join(_SET.value) or "config"
  print(f"[probe] {label}: {len(train)} train / {len(test)} test screens, batch {batch}, lr {lr}, "
        f"{_STEPS.value} updates, backend {jax.default_backend()}", flush=True)
  rng, t0, t_train, rows = np.random.default_rng(config.seed), time.time(), 0.0, []
  eval_at = sorted(int(x) for x in _EVAL_AT.value)
  for step in range(1, _STEPS.value + 1):
    idx = rng.choice(len(eps), batch, replace=False)
    b = collate([eps[i] for i in idx], pad_id=tok.pad_id, max_images=1, image_hw=parts.image_hw,
                length_multiple=config.length_multiple, batch_size=batch).as_dict()
    params, opt_state, m = sft.train_step(params, opt_state, b, parts.table, graphdef=parts.policy_gd, opt=opt,
                                          inputs=parts.inputs, aux_coef=config.rl.aux_loss_coef)
    if step == 1:  # compilation is not a step's cost
      jax.block_until_ready(params)
      t_mark = time.time()
    if step in eval_at or step == _STEPS.value:
      jax.block_until_ready(params)
      t_train += time.time() - t_mark  # wall clock of the updates (batching included), evaluations excluded
      res = evaluate(params)
      t_mark = time.time()
      rows.append({"step": step, "ce_free": float(m["ce_free"]), "seconds": time.time() - t0,
                   "step_seconds": t_train / max(1, step - 1), **res})
      print(f"[probe] {label} step {step}: ce/free {float(m['ce_free']):.3f} "
            + " ".join(f"{t.split('/')[-1]} {v['hit']:.3f} (other {v['other']:.3f})" for t, v in res.items())
            + f" | {time.time() - t0:.0f} s", flush=True)
      if _MAX_SECONDS.value and time.time() - t0 > _MAX_SECONDS.value:
        break
  if _JSON.value:
    with open(_JSON.value, "a") as f:
      f.write(json.dumps({"label": label, "set": _SET.value, "init": _INIT.value, "train_screens": len(train),
                          "batch": batch, "lr": lr, "steps": _STEPS.value,
                          "backend": jax.default_backend(), "rows": rows}) + "\n")


if __name__ == "__main__":
  app.run(main)
