"""Helpers of the issue-#3 benchmarks: the train-step batch layout, the benchmark's LM loss against a
numpy cross-entropy of the same logits, and the `--moe_impl` pass-through."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import bench_model
from benchmarks.bench_model import N_IMG, lm_loss, make_batch
from tars_jax.agent.tokenizer import BOS, IMAGE, VISION_END, VISION_START
from tars_jax.models import ModelConfig, Policy, rope_positions
from _shared import TINY_CFG, f32_atol, forward_terms, fwd


def test_make_batch_layout_and_error():
  ids, images = make_batch(np.random.default_rng(0), 3, 40)
  assert ids.shape == (3, 40) and images.shape == (3, 112, 112, 3) and images.dtype == np.uint8
  assert (ids[:, 0] == BOS).all() and (ids[:, 9] == VISION_START).all() and (ids[:, 10 + N_IMG] == VISION_END).all()
  assert ((ids == IMAGE).sum(1) == N_IMG).all()
  with pytest.raises(ValueError, match="too short"):
    make_batch(np.random.default_rng(0), 1, 20)


def test_lm_loss_is_mean_next_token_cross_entropy():
  cfg = TINY_CFG
  pol = Policy(cfg, nnx.Rngs(0))
  rng = np.random.default_rng(1)
  n = cfg.n_img_tokens
  toks = jnp.asarray([[BOS, 5, 6, VISION_START] + [IMAGE] * n + [VISION_END, 7, 8, 9]] * 2, jnp.int32)
  mask = jnp.ones(toks.shape, bool)
  pos = rope_positions(toks, mask, IMAGE, cfg.merged_grid)
  pix = jnp.asarray(rng.random((2, 1, cfg.image_h, cfg.image_w, 3)), jnp.float32)
  gd, params = nnx.split(pol)
  got = float(jax.jit(lm_loss, static_argnums=1)(params, gd, toks, pos, mask, pix))  # eager op-by-op took 35 s
  logits = np.asarray(fwd(pol, toks, pos, mask, pix)[0], np.float64)[:, :-1]
  z = logits - logits.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  want = -np.take_along_axis(logp, np.asarray(toks)[:, 1:, None], -1).mean()
  assert abs(got - want) <= f32_atol(abs(want), forward_terms(cfg, toks.shape[1]))  # float32 rule; mean -log p > 0


def test_moe_impl_override():
  assert bench_model.overrides(None) == {}
  has_field = "moe_impl" in {f.name for f in dataclasses.fields(ModelConfig)}
  if has_field:
    assert bench_model.overrides("dense") == {"moe_impl": "dense"}
  else:
    with pytest.raises(ValueError, match="moe_impl"):
      bench_model.overrides("dense")
    assert bench_model.moe_impl_name(ModelConfig()) == "dense"


def test_reported_command_says_how_it_was_run():
  """`benchmarks.command.command_line` prefixes `nice -n N` exactly when the process runs niced."""
  import subprocess
  import sys
  code = "from benchmarks.command import command_line; print(command_line('benchmarks.soak', '--sessions 2'))"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root)
  plain = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
  niced = subprocess.run(["nice", "-n", "7", sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, check=True)
  base = os.nice(0)  # the test runner's own niceness is inherited by both children
  prefix = f"nice -n {base} " if base > 0 else ""
  assert plain.stdout.strip() == prefix + ".venv/bin/python -m benchmarks.soak --sessions 2"
  assert niced.stdout.strip() == f"nice -n {min(base + 7, 19)} .venv/bin/python -m benchmarks.soak --sessions 2"


def test_gpu_benchmark_preset_and_peaks():
  """The MFU benchmark's model is what its docstring says (3.44B parameters, 196 image tokens per
  448x448 image) and its peak table finds the GPU by `device_kind`."""
  from benchmarks.bench_model import bench_config
  from benchmarks.bench_model import datasheet_peak
  from tars_jax.models.interop.hf_model import HFModel
  cfg = bench_config("a3b8")
  model = nnx.eval_shape(lambda: HFModel(cfg, nnx.Rngs(0)))
  assert round(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) / 1e9, 2) == 3.44
  assert cfg.n_img_tokens == 196 and cfg.scan_layers
  assert datasheet_peak("NVIDIA H100 80GB HBM3") == 989.4e12 and datasheet_peak("cpu") is None
  with pytest.raises(KeyError, match="known"):
    bench_config("nope")


@pytest.mark.long
def test_gpu_benchmark_runs_end_to_end_on_the_smoke_preset(tmp_path):
  """`benchmarks/train_step_gpu.py --preset smoke` on the CPU: transformers builds and saves the
  weights, both sides train on them, and the JSON it writes says the two sides computed the same loss
  (bfloat16 compute: within 1e-2) with the model FLOPs of `tars_jax.models.flops`, and our rows report
  their compiled step's temporaries."""
  import json
  import subprocess
  import sys
  from benchmarks.bench_model import bench_config
  from tars_jax.models import flops
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "mfu.json"
  subprocess.run([sys.executable, "-m", "benchmarks.train_step_gpu", "--preset", "smoke", "--batch", "2", "--seq", "64",
                  "--repeats", "1", "--warmup", "1", "--moe_impls", "ragged,grouped", "--json", str(out)],
                 cwd=root, env={**os.environ, "PYTHONPATH": root}, check=True, capture_output=True, text=True)
  res = json.loads(out.read_text())
  rows = {r["name"]: r for r in res["rows"]}
  assert set(rows) == {"torch (transformers)", "ours ragged", "ours grouped"}
  assert all("error" not in r for r in rows.values()), rows
  torch_loss = rows["torch (transformers)"]["loss"]
  for name in ("ours ragged", "ours grouped"):
    assert abs(rows[name]["loss"] - torch_loss) < 1e-2, (name, rows[name]["loss"], torch_loss)
    assert rows[name]["mfu_measured_peak"] > 0 and rows[name]["xla_flops"] > 0
    assert rows[name]["temp_gb"] > 0  # the step's own buffers, from compiled.memory_analysis()
  assert res["model_flops_per_step"] == flops.forward_flops(bench_config("smoke"), 2, 64, images_per_row=1).train_step


def test_env_throughput_combines_rounds_by_median_and_per_round_ratios():
  """Each round's ratio is ours over that round's own ceiling (not median over median), medians per
  column, resets summed; the raw step's bound is raw step / raw per round; the table cell shows
  median (min-max)."""
  from benchmarks.env_throughput import _ratio_cell, combine_rounds
  rounds = [({"steps_per_s": 60.0, "steps": 480, "resets": 10, "p50_ms": 200.0}, {"shots_per_s": 100.0},
             {"shots_per_s": 200.0}, {"shots_per_s": 50.0}),
            ({"steps_per_s": 80.0, "steps": 640, "resets": 12, "p50_ms": 150.0}, {"shots_per_s": 200.0},
             {"shots_per_s": 320.0}, {"shots_per_s": 160.0}),
            ({"steps_per_s": 70.0, "steps": 560, "resets": 11, "p50_ms": 170.0}, {"shots_per_s": 125.0},
             {"shots_per_s": 0.0}, {"shots_per_s": 100.0})]  # a failed CDP ceiling gives no ratio
  o, r, rc, rs = combine_rounds(rounds)
  assert o["steps_per_s"] == 70.0 and o["p50_ms"] == 170.0 and o["resets"] == 33 and o["steps"] == 1680
  assert r["shots_per_s"] == 125.0 and rc["shots_per_s"] == 200.0 and rs["shots_per_s"] == 100.0
  assert o["ratio_raw"] == [0.4, 0.56, 0.6]  # 80/200, 70/125, 60/100
  assert o["ratio_cdp"] == [0.25, 0.3]
  assert o["ratio_step"] == [0.5, 0.7, 1.2]  # 80/160, 70/100, 60/50
  assert rs["ratio_raw"] == [0.5, 0.8, 0.8]  # 50/100, 160/200, 100/125
  assert _ratio_cell(o["ratio_raw"]) == "0.56 (0.40-0.60)" and _ratio_cell([0.5]) == "0.50" and _ratio_cell([]) == "-"
  o3, _, _ = combine_rounds([x[:3] for x in rounds])  # without a raw step: no step ratio
  assert o3["ratio_raw"] == o["ratio_raw"] and "ratio_step" not in o3
  with pytest.raises(ValueError):
    combine_rounds([])
  with pytest.raises(ValueError, match="lengths"):
    combine_rounds([rounds[0], rounds[1][:3]])


def test_page_call_cost_sorts_processes_and_compares_each_round_with_its_capture():
  """CPU goes to the column of the process's Chromium --type (or driver / this process); each
  variant's ratio is taken against the capture of its own round, then the median over rounds."""
  import os

  from benchmarks.page_call_cost import process_kind, summarise
  shell = "/usr/lib/chromium/chromium-headless-shell"
  assert process_kind([shell, "--no-sandbox"], 10, 99) == "browser"
  assert process_kind([shell, "--type=renderer", "--lang=en-US"], 11, 99) == "renderer"
  assert process_kind([shell, "--type=gpu-process"], 12, 99) == "gpu"
  assert process_kind([shell, "--type=utility", "--utility-sub-type=network.mojom.NetworkService"], 13, 99) == "other"
  assert process_kind(["node", "cli.js", "run-driver"], 99, 99) == "driver"
  assert process_kind(["python"], os.getpid(), 99) == "python"
  assert process_kind(["bash"], 14, 99) is None
  rounds = [{"capture": {"ops_per_s": 400.0, "total": 5.0}, "step": {"ops_per_s": 130.0, "total": 15.0}},
            {"capture": {"ops_per_s": 300.0, "total": 6.0}, "step": {"ops_per_s": 150.0, "total": 12.0}},
            {"capture": {"ops_per_s": 350.0, "total": 4.0}, "step": {"ops_per_s": 140.0, "total": 14.0}}]
  t = summarise(rounds)
  assert t["capture"]["ops_per_s"] == 350.0 and t["step"]["total"] == 14.0
  assert t["step"]["vs_capture"] == 3.0  # per round 3.0, 2.0, 3.5 (median over medians would give 14/5 = 2.8)
  assert t["capture"]["vs_capture"] == 1.0
  with pytest.raises(ValueError):
    summarise([])


@pytest.mark.long
def test_train_step_memory_counts_parameters_and_batch():
  """`benchmarks/bench_model.step_memory` on the smoke preset: the compiled step's argument bytes
  are the float32 parameters plus the batch arrays (counted here from the abstract model), its outputs
  the loss plus one float32 gradient per parameter, and a "recompute" attention keeps no more
  temporaries than "einsum"."""
  from benchmarks.bench_model import bench_config
  from benchmarks.bench_model import step_memory
  b, t = 2, 64
  cfg = bench_config("smoke", dtype="bfloat16")
  leaves = jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: Policy(cfg, nnx.Rngs(0)))))
  n_params = sum(x.size for x in leaves)
  batch = b * t * 4 + b * t + 3 * b * t * 4 + b * cfg.image_h * cfg.image_w * 3 * 4  # ids, mask, positions, pixels
  m = {impl: step_memory(dataclasses.replace(cfg, attention_impl=impl), b, t) for impl in ("einsum", "recompute")}
  assert m["einsum"]["args"] == 4 * n_params + batch
  # outputs: the loss and the gradients, plus XLA's tuple index tables (8-byte pointers per element)
  assert 4 * n_params + 4 <= m["einsum"]["out"] <= 4 * n_params + 4 + 8 * (len(leaves) + 2)
  assert 0 < m["recompute"]["temp"] <= m["einsum"]["temp"]
