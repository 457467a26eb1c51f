"""Parameter interpolation of Orbax checkpoints (tars_jax/merge.py, report section 2.6): on real trainer
checkpoints of the smoke policy (`miniwob_pipeline:+smoke`, written by train.checkpoint.save) and on
plain StandardCheckpointer dirs, θ = Σ α θ_k and θ_base + Σ λ (θ_k − θ_base) equal numpy's float64
values within float32 rounding; integer leaves come from the first checkpoint; the output is read by
eval.py's and `--config.policy.init`'s code and, through hf_io.save_pretrained, by transformers with
the same logits; bad input (structure, dtype, scanned layout, config, α) is refused before anything
is written; peak memory stays near one model (subprocess, ru_maxrss); on 8 simulated devices each
leaf is read into its sharding (subprocess); the CLI prints where the result is and how to evaluate it."""

import json
import os
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tars_jax import merge
from tars_jax.train import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = {"a": 10, "b": 20, "c": 30}


def _config():
  from experiments.configs import miniwob_pipeline
  return miniwob_pipeline.get_config("+smoke")


@pytest.fixture(scope="module")
def parts():
  from tars_jax.train import state as state_lib
  return state_lib.build(_config())


@pytest.fixture(scope="module")
def abstract(parts):
  """The train state's structure (nnx.State + optax states), shapes and dtypes; nothing allocated."""
  return jax.eval_shape(parts.init_state, 0)


def _random_state(abstract, seed: int, step: int):
  """A train state of `abstract`'s structure with distinct random values (norm scales near 1, other
  floats ~0.1 N(0, 1), Adam moments included) and every integer (step, optimiser counts) = `step`.
  Random values instead of `init_state(seed)`: the eager init of the smoke model takes ~20 s here."""
  rng = np.random.default_rng(seed)

  def leaf(x):
    if not np.issubdtype(x.dtype, np.floating):
      return np.full(x.shape, step, x.dtype)
    return (0.1 * rng.standard_normal(x.shape) + (1.0 if len(x.shape) == 1 else 0.0)).astype(x.dtype)
  return jax.tree.map(leaf, abstract)


@pytest.fixture(scope="module")
def runs(parts, abstract, tmp_path_factory):
  """{name: (run dir, state)}: three trainer runs (config.json + checkpoints/<step> with "state" and
  "meta"), as experiments/sft.py and train.py write them."""
  root = tmp_path_factory.mktemp("runs")
  out = {}
  for seed, (name, step) in enumerate(STEPS.items()):
    state = _random_state(abstract, seed, step)
    mngr = ckpt.manager(str(root / name))
    ckpt.save(mngr, step, state, {"iteration": step, "run": name})
    mngr.close()
    (root / name / "config.json").write_text(parts.config.to_json_best_effort(indent=2))
    out[name] = (str(root / name), state)
  return out


def _flat(tree) -> dict:
  """{key path (strings): numpy array}: the same keys for a restored state and Orbax's metadata."""
  return {merge._keypath(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _f64(x):
  return np.asarray(x, np.float64)


def _save_tree(path, tree) -> str:
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.abspath(path), tree)
  ckptr.wait_until_finished()
  return str(path)


def test_interpolate_trainer_runs_equals_numpy_average(parts, abstract, runs, tmp_path):
  from tars_jax.rollout.evaluation import resolve_run
  from tars_jax.train import state as state_lib
  from _shared import assert_close_f32
  alphas, names = [0.5, 0.3, 0.2], "abc"
  out = tmp_path / "merged"
  r = merge.interpolate([runs[n][0] for n in names], alphas, str(out), chunk_bytes=1 << 20)  # several groups
  assert (r.kind, r.step, r.checkpoint, r.copied) == ("trainer", 10, str(out / "checkpoints" / "10"), 1)

  # Read back as experiments/eval.py does: the run dir, its config, the state in init_state's structure.
  run = resolve_run(str(out))
  assert json.load(open(os.path.join(run, "config.json"))) == json.load(open(os.path.join(runs["a"][0], "config.json")))
  step, got, meta = ckpt.restore(ckpt.manager(run), abstract)
  assert step == 10 and meta["iteration"] == 10 and meta["run"] == "a"  # the first checkpoint's meta
  assert meta["merge"]["alphas"] == alphas and json.load(open(out / "merge.json"))["op"] == "interpolate"
  inputs = [_flat(runs[n][1]) for n in names]
  n_merged = 0
  for path, x in _flat(got).items():
    if merge.is_optimizer(path):
      assert not np.any(x), path  # reset (the default): a fresh optimiser
    elif x.dtype.kind == "f":
      want = sum(a * _f64(xs[path]) for a, xs in zip(alphas, inputs))
      assert_close_f32(x, want, terms=len(alphas), err_msg="/".join(path))
      n_merged += 1
    else:
      np.testing.assert_array_equal(x, inputs[0][path])  # the step counter: from "a", not averaged
  assert n_merged == r.merged > 0 and int(got["step"]) == STEPS["a"]
  # The reset optimiser state is exactly optax's fresh state for these parameters.
  fresh = parts.popt.init(got["policy"])
  assert jax.tree.structure(fresh) == jax.tree.structure(got["policy_opt"])
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(fresh), jax.tree.leaves(got["policy_opt"])))

  # `--config.policy.init=<out>` (train.state.load_policy) reads the merged policy.
  state, src = state_lib.load_policy(abstract, str(out), parts.popt)
  assert src.endswith("checkpoints/10")
  for x, y in zip(jax.tree.leaves(state["policy"]), jax.tree.leaves(got["policy"])):
    np.testing.assert_array_equal(x, y)


def test_optimizer_state_first_or_merged(abstract, runs, tmp_path):
  a, b = _flat(runs["a"][1]), _flat(runs["b"][1])
  for mode in ("first", "merge"):
    out = tmp_path / mode
    merge.interpolate([runs["a"][0], runs["b"][0] + "/checkpoints/20"], [0.25, 0.75], str(out), optimizer=mode)
    _, got, _ = ckpt.restore(ckpt.manager(str(out)), abstract)
    for path, x in _flat(got).items():
      if not merge.is_optimizer(path):
        continue
      if mode == "first" or x.dtype.kind != "f":  # counts: from the first checkpoint in both modes
        np.testing.assert_array_equal(x, a[path], err_msg="/".join(path))
      else:
        np.testing.assert_allclose(x, 0.25 * _f64(a[path]) + 0.75 * _f64(b[path]), rtol=1e-6, atol=1e-7)


def test_task_arithmetic_equals_numpy(abstract, runs, tmp_path):
  lambdas = [0.6, 0.9]
  out = tmp_path / "ta"
  r = merge.task_arithmetic(runs["a"][0], [runs["b"][0], runs["c"][0]], lambdas, str(out))
  assert (r.kind, r.step) == ("trainer", STEPS["b"])  # integer leaves and meta: the first checkpoint, not the base
  step, got, meta = ckpt.restore(ckpt.manager(str(out)), abstract)
  assert step == 20 and meta["run"] == "b" and meta["merge"]["base"] == runs["a"][0]
  base, b, c = (_flat(runs[n][1]) for n in "abc")
  for path, x in _flat(got).items():
    if merge.is_optimizer(path):
      continue
    if x.dtype.kind == "f":
      want = _f64(base[path]) + lambdas[0] * (_f64(b[path]) - base[path]) + lambdas[1] * (_f64(c[path]) - base[path])
      scale = max(np.abs(v[path]).max() for v in (base, b, c))  # the rounding is relative to the inputs
      np.testing.assert_allclose(x, want, rtol=0, atol=8 * np.finfo(np.float32).eps * 3 * scale)
    else:
      np.testing.assert_array_equal(x, b[path])


def _tree(seed: int, **over):
  """A StandardCheckpointer tree of every leaf kind: float32, bfloat16, a list of layers, int, bool."""
  rng = np.random.default_rng(seed)
  t = {"enc": {"w": rng.standard_normal((4, 3)).astype(np.float32)},
       "head": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
       "layers": [{"k": rng.standard_normal(2).astype(np.float32)} for _ in range(2)],
       "count": np.asarray(seed + 7, np.int32), "mask": rng.random(3) < 0.5}
  t.update(over)
  return t


def test_pytree_dirs_of_any_structure(tmp_path):
  trees = [_tree(s) for s in range(3)]
  dirs = [_save_tree(tmp_path / f"t{s}", t) for s, t in enumerate(trees)]
  alphas = [0.2, 0.3, 0.5]
  r = merge.interpolate(dirs, alphas, str(tmp_path / "out"), chunk_bytes=0)  # strictly one leaf per read
  assert (r.kind, r.checkpoint, r.step, r.merged, r.copied) == ("tree", str(tmp_path / "out"), None, 4, 2)
  got = ckpt.restore_tree(r.checkpoint, trees[0])  # what a StandardCheckpointer user does
  want = lambda f: sum(a * _f64(f(t)) for a, t in zip(alphas, trees))  # noqa: E731
  np.testing.assert_allclose(got["enc"]["w"], want(lambda t: t["enc"]["w"]), rtol=1e-6)
  np.testing.assert_allclose(got["layers"][1]["k"], want(lambda t: t["layers"][1]["k"]), rtol=1e-6)
  assert got["head"].dtype == ml_dtypes.bfloat16  # accumulated in float32, stored back in bfloat16
  np.testing.assert_allclose(_f64(got["head"]), want(lambda t: t["head"]), rtol=2 ** -8)
  assert int(got["count"]) == 7 and np.array_equal(got["mask"], trees[0]["mask"])  # from the first


def _refused(fn, exc, match, out):
  with pytest.raises(exc, match=match) as e:
    fn()
  assert not os.path.exists(out), "a refused merge wrote something"
  return e.value


def test_structure_mismatch_names_the_leaf_and_both_shapes_and_writes_nothing(tmp_path):
  a = _save_tree(tmp_path / "a", _tree(0))
  out = str(tmp_path / "out")
  cases = {
      "shape": (_tree(1, enc={"w": np.zeros((4, 5), np.float32)}), r"'enc/w'.*\(4, 3\) float32.*\(4, 5\) float32"),
      "dtype": (_tree(1, head=np.zeros(5, np.float32)), r"'head'.*\(5,\) bfloat16.*\(5,\) float32"),
      "layers": (_tree(1, layers=[{"k": np.zeros(2, np.float32)}]), r"'layers/1/k'.*\(2,\) float32 in .*absent"),
  }
  for name, (tree, match) in cases.items():
    b = _save_tree(tmp_path / name, tree)
    err = _refused(lambda: merge.interpolate([a, b], [0.5, 0.5], out), merge.StructureMismatch, match, out)
    assert err.path in ("enc/w", "head", "layers/1/k")
  assert err.shapes == ((2,), None)
  # Scanned vs unscanned layers: per-layer leaves 'blocks/<i>/w' against one stacked 'blocks/w' [2, 3].
  per_layer = _save_tree(tmp_path / "unscanned", {"blocks": {"0": {"w": np.zeros(3, np.float32)},
                                                             "1": {"w": np.zeros(3, np.float32)}}})
  stacked = _save_tree(tmp_path / "scanned", {"blocks": {"w": np.zeros((2, 3), np.float32)}})
  err = _refused(lambda: merge.interpolate([per_layer, stacked], [0.5, 0.5], out), merge.StructureMismatch,
                 r"'blocks/0/w': \(3,\) float32 in .*'blocks/w' \(2, 3\) float32 in .*scanned vs unscanned", out)
  assert err.shapes == ((3,), (2, 3))


def test_other_bad_input_is_refused_before_writing(runs, tmp_path):
  out = str(tmp_path / "out")
  a = runs["a"][0]
  # A run of another model config (scan_layers flipped): named, even before the leaves are compared.
  other = tmp_path / "scanned_run"
  shutil.copytree(a, other)
  cfg = json.load(open(other / "config.json"))
  cfg["model"]["scan_layers"] = not cfg["model"]["scan_layers"]
  (other / "config.json").write_text(json.dumps(cfg))
  err = _refused(lambda: merge.interpolate([a, str(other)], [0.5, 0.5], out), merge.ConfigMismatch,
                 r"model\.scan_layers = False in .*True in", out)
  assert err.key == "model.scan_layers"
  # A run fine-tuned from another SFT checkpoint: both starts named; merged only when asked for.
  moved = tmp_path / "other_start"
  shutil.copytree(a, moved)
  cfg = json.load(open(moved / "config.json"))
  cfg["policy"]["init"] = "runs/other_sft"
  (moved / "config.json").write_text(json.dumps(cfg))
  err = _refused(lambda: merge.interpolate([a, str(moved)], [0.5, 0.5], out), merge.DifferentStarts,
                 r"started from fresh init \(seed \d+\), .*other_start from runs/other_sft.*--allow_different_starts",
                 out)
  assert err.starts == (f"fresh init (seed {cfg['seed']})", "runs/other_sft")
  _refused(lambda: merge.task_arithmetic(a, [runs["b"][0], str(moved)], [0.5, 0.5], out), merge.DifferentStarts,
           "other_sft", out)
  merge.task_arithmetic(str(moved), [a, runs["b"][0]], [0.5, 0.5], str(tmp_path / "ta_ok"))  # the base's own start is not compared
  merge.interpolate([a, str(moved)], [0.5, 0.5], str(tmp_path / "allowed"), allow_different_starts=True)
  tree = _save_tree(tmp_path / "tree", _tree(0))
  _refused(lambda: merge.interpolate([a, tree], [0.5, 0.5], out), merge.MergeError, "mix", out)
  _refused(lambda: merge.interpolate([a, str(tmp_path / "nowhere")], [0.5, 0.5], out), FileNotFoundError,
           "nowhere", out)
  _refused(lambda: merge.interpolate([a, a + "/checkpoints/7"], [0.5, 0.5], out), FileNotFoundError,
           "no checkpoint 7", out)
  _refused(lambda: merge.interpolate([a, runs["b"][0]], [0.5, 0.5], a + "/merged"), merge.MergeError,
           "overlaps", a + "/merged")
  one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  _refused(lambda: merge.interpolate([tree, tree], [0.5, 0.5], out, shardings={"enc": {"w": one_device}}),
           merge.MergeError, "no entry for 5 checkpoint leaves", out)
  os.makedirs(tmp_path / "full")
  (tmp_path / "full" / "x").write_text("")
  with pytest.raises(FileExistsError, match="not empty"):
    merge.interpolate([a, runs["b"][0]], [0.5, 0.5], str(tmp_path / "full"))
  assert os.listdir(tmp_path / "full") == ["x"]


def test_alphas_must_sum_to_one_unless_allowed(tmp_path):
  trees = [_tree(0), _tree(1)]
  dirs = [_save_tree(tmp_path / f"t{k}", t) for k, t in enumerate(trees)]
  out = str(tmp_path / "out")
  _refused(lambda: merge.interpolate(dirs, [0.6, 0.6], out), merge.UnnormalisedWeights, r"sum to 1\.2", out)
  _refused(lambda: merge.interpolate(dirs, [1.0], out), merge.MergeError, "1 alphas for 2", out)
  _refused(lambda: merge.interpolate(dirs, [0.5, float("nan")], out), merge.MergeError, "finite", out)
  merge.interpolate(dirs, [0.5, 0.5 + 5e-7], out)  # within the 1e-6 tolerance
  r = merge.interpolate(dirs, [0.6, 0.6], str(tmp_path / "scaled"), allow_unnormalised=True)
  got = ckpt.restore_tree(r.checkpoint, trees[0])
  np.testing.assert_allclose(got["enc"]["w"], 0.6 * _f64(trees[0]["enc"]["w"]) + 0.6 * trees[1]["enc"]["w"], rtol=1e-6)


def test_hf_round_trip_of_the_merged_policy(parts, abstract, runs, tmp_path):
  """Merged params -> hf_io.save_pretrained -> transformers -> the logits of our model on the same
  merged params (image and text tokens)."""
  import torch  # installed by scripts/setup.sh: a missing torch fails, never skips
  from flax import nnx
  from transformers import AutoModelForImageTextToText
  from tars_jax.agent.tokenizer import BOS, IMAGE, VISION_END, VISION_START
  from tars_jax.models.interop import hf_io
  from tars_jax.models.interop.hf_model import HFModel
  from tars_jax.train import state as state_lib
  from _shared import assert_close_f32, forward_terms
  merge.interpolate([runs["a"][0], runs["b"][0]], [0.4, 0.6], str(tmp_path / "merged"))
  state, _ = state_lib.load_policy(abstract, str(tmp_path / "merged"), parts.popt)
  cfg = parts.model_cfg
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: HFModel(cfg, nnx.Rngs(0))))
  ours = nnx.merge(graphdef, nnx.State({"policy": state["policy"]}))
  hf_io.save_pretrained(ours, str(tmp_path / "hf"))
  hf = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf")).eval()

  rng = np.random.default_rng(0)
  gh, gw = cfg.image_h // cfg.patch_size, cfg.image_w // cfg.patch_size
  m = cfg.spatial_merge_size
  ids = np.array([[BOS, 70, 71, VISION_START] + [IMAGE] * (gh * gw // m ** 2) + [VISION_END, 80, 81, 82]])
  pixels = rng.standard_normal((gh * gw, 3 * cfg.temporal_patch_size * cfg.patch_size ** 2)).astype(np.float32)
  thw = np.array([[1, gh, gw]])
  got = np.asarray(ours(ids, None, pixels, thw))
  with torch.no_grad():
    want = hf(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(thw),
              mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64))).logits.numpy()
  assert np.abs(want).max() > 0.1  # not a vacuous comparison
  assert_close_f32(got, want, terms=forward_terms(cfg, ids.shape[1]))


# --- subprocesses: peak memory, 8 simulated devices, the CLI -----------------------------------------

def _python(args, env=None, timeout=300):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **(env or {}))
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


RSS_LEAVES, RSS_LEAF_ELEMS = 20, 2 << 20  # 20 float32 leaves of 8 MiB: a 160 MiB model


def test_peak_memory_is_near_one_model_not_n(tmp_path):
  """Three checkpoints of a 160 MiB model merged in a fresh process: the growth of its peak RSS
  (VmHWM, i.e. ru_maxrss of the process image) over the merge stays under 2.5 models (the merged
  model, Orbax's 100 MB OCDBT read cache, a few groups in flight; measured 1.8), where reading the
  inputs whole needs 4 (three inputs + the result; one group of the whole model measured 3.2)."""
  model_bytes = RSS_LEAVES * RSS_LEAF_ELEMS * 4
  for k in range(3):
    rng = np.random.default_rng(k)
    tree = {f"w{i:02d}": rng.standard_normal(RSS_LEAF_ELEMS, dtype=np.float32) for i in range(RSS_LEAVES)}
    _save_tree(tmp_path / f"c{k}", dict(tree, step=np.asarray(k, np.int32)))
    del tree
  p = _python([__file__, "rss", str(tmp_path)])
  assert p.returncode == 0, p.stderr[-3000:]
  extra = json.loads(p.stdout.strip().splitlines()[-1])["extra_bytes"]
  print(f"peak RSS growth {extra / 2**20:.0f} MiB = {extra / model_bytes:.2f} x the model "
        f"({model_bytes / 2**20:.0f} MiB)")
  assert extra < 2.5 * model_bytes


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _rss_worker(root):
  # The peak RSS of this process image (VmHWM, what ru_maxrss reports), reset after the warm-up by
  # writing 5 to clear_refs: ru_maxrss itself would carry the forking pytest process's peak across exec.
  tiny = [_save_tree(os.path.join(root, f"tiny{k}"), {"w": np.zeros(4, np.float32)}) for k in range(2)]
  merge.interpolate(tiny, [0.5, 0.5], os.path.join(root, "tiny_out"))  # imports, thread pools: not counted
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  before = _status_kib("VmRSS")
  assert _status_kib("VmHWM") <= before + 1024, "peak RSS was not reset"
  merge.interpolate([os.path.join(root, f"c{k}") for k in range(3)], [0.2, 0.3, 0.5], os.path.join(root, "out"),
                    chunk_bytes=8 << 20)
  print(json.dumps({"extra_bytes": (_status_kib("VmHWM") - before) * 1024}))


def test_each_leaf_is_read_into_its_sharding_on_a_mesh(runs, tmp_path):
  """8 simulated CPU devices, mesh (data 2, fsdp 4): the decoder parameters of two runs' policies (as
  `checkpoint.save_tree` writes them) merged with the shardings the logical-axis rules give them
  (`sharding.logical_to_sharding`, an nnx.State matched by key path); the merged checkpoint records
  each leaf's NamedSharding and holds numpy's average. (The decoder alone: on simulated devices Orbax
  compiles a slice per sharded leaf shape when it saves, about a second per ten leaves.)"""
  dirs = [ckpt.save_tree(str(tmp_path / n), runs[n][1]["policy"]["trunk"]["decoder"]) for n in "ab"]
  p = _python([__file__, "mesh", *dirs, str(tmp_path / "out")],
              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert p.returncode == 0, p.stderr[-3000:]
  res = json.loads(p.stdout.strip().splitlines()[-1])
  assert res["devices"] == 8 and res["leaves"] > 10
  assert res["specs_match"] == res["leaves"] and res["sharded"] > 0  # every leaf as the rules shard it
  assert res["q_spec"] == ["fsdp", "None"]  # e.g. q_proj [embed, heads * head_dim]: model width over fsdp
  assert res["max_err"] < 1e-6


def _numpy_tree(tree_dir) -> dict:
  md = ocp.PyTreeCheckpointer().metadata(tree_dir).item_metadata.tree
  tree = ocp.PyTreeCheckpointer().restore(tree_dir, args=ocp.args.PyTreeRestore(
      restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), md)))
  return _flat(tree)


def _mesh_worker(dir_a, dir_b, out):
  from tars_jax import sharding
  from tars_jax.train import state as state_lib
  config = _config()
  config.mesh.shape = (2, 4, 1, 1)
  parts = state_lib.build(config)
  decoder = jax.eval_shape(parts.init_state, 0)["policy"]["trunk"]["decoder"]
  shardings = sharding.logical_to_sharding(decoder, parts.mesh, parts.rules)
  r = merge.interpolate([dir_a, dir_b], [0.3, 0.7], out, shardings=shardings)
  md = _flat_metadata(r.checkpoint)
  want = {merge._keypath(p): s for p, s in jax.tree_util.tree_flatten_with_path(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]}

  def axes(spec):  # mesh axes of size 1 shard nothing: a computed array's spec may name them or not
    return [str(a) if a is not None and parts.mesh.shape[a] > 1 else "None" for a in spec]

  def padded(spec, ndim):
    return axes(tuple(spec) + (None,) * (ndim - len(tuple(spec))))
  specs_match = sum(padded(m.sharding.partition_spec, len(m.shape)) == padded(want[p].spec, len(m.shape))
                    for p, m in md.items())
  sharded = sum(1 for m in md.values() if set(axes(m.sharding.partition_spec)) - {"None"})
  a, b, got = _numpy_tree(dir_a), _numpy_tree(dir_b), _numpy_tree(out)
  err = max(float(np.abs(x - (0.3 * _f64(a[p]) + 0.7 * _f64(b[p]))).max()) for p, x in got.items())
  key = ("layers", "0", "self_attn", "q_proj", "kernel", "value")
  q_spec = padded(md[key].sharding.partition_spec, len(md[key].shape))
  print(json.dumps({"devices": jax.device_count(), "leaves": len(md), "specs_match": int(specs_match),
                    "sharded": sharded, "q_spec": q_spec, "max_err": err}))


def _flat_metadata(tree_dir) -> dict:
  md = ocp.PyTreeCheckpointer().metadata(tree_dir).item_metadata.tree
  return {merge._keypath(p): m for p, m in jax.tree_util.tree_flatten_with_path(md)[0]}


def test_cli_task_arithmetic_and_refusal(runs, tmp_path):
  out = tmp_path / "ta"
  p = _python(["-m", "experiments.merge", "--base", runs["a"][0], "--ckpt", runs["b"][0], "--ckpt", runs["c"][0],
               "--lambdas", "0.5,0.25", "--out", str(out)])
  assert p.returncode == 0, p.stderr[-3000:]
  line = p.stdout.strip().splitlines()[-1]
  assert "θ_base + 0.5·(θ1 − θ_base) + 0.25·(θ2 − θ_base)" in line and str(out / "checkpoints" / "20") in line
  assert f"python -m experiments.eval --run {out}" in line
  assert json.load(open(out / "merge.json"))["lambdas"] == [0.5, 0.25]
  p = _python(["-m", "experiments.merge", "--ckpt", runs["a"][0], "--ckpt", runs["b"][0], "--alpha", "0.6,0.6",
               "--out", str(tmp_path / "no")])
  assert p.returncode != 0 and "UnnormalisedWeights" in p.stderr and "--allow_unnormalised" in p.stderr
  assert not os.path.exists(tmp_path / "no")


if __name__ == "__main__":  # the subprocess workers above
  {"rss": _rss_worker, "mesh": _mesh_worker}[sys.argv[1]](*sys.argv[2:])
