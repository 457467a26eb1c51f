"""Sharding (`tars_jax/sharding.py`) and MoE expert-parallel routing.

In this process (1 device): every parameter has logical axis names; the ragged (sort + `ragged_dot`)
MoE equals the dense one in outputs and gradients and keeps transformers parity; the capacity
factor drops exactly the assignments a numpy reference drops.

In a subprocess with 8 simulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`
must be set before jax is imported, so this file re-runs itself as a script): for meshes
(data, fsdp, tensor, expert) = (8,1,1,1), (2,2,2,1), (2,1,2,2) the loss and gradients of the real
PPO policy loss of a tiny MoE `Policy` equal the single-device ones within 1e-5, one real
`ppo.policy_step` keeps the parameters distributed, the parameters' device shards have the shapes
the rules say, a mesh axis that does not divide a dimension is a typed error naming rule, axis and
dimension, and `hf_io.load_pretrained(path, mesh=...)` places each tensor by the rules.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

# Imported here by pytest (1 device) and by the worker subprocess (its XLA_FLAGS already set).
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from tars_jax import sharding  # noqa: E402
from tars_jax.models import Policy, ValueModel  # noqa: E402
from tars_jax.models import moe  # noqa: E402
from tars_jax.models.moe import MoE, capacity, route  # noqa: E402
from _shared import assert_close_f32, f32_atol, forward_terms  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


def _small_cfg(**kw):
  """Tiny MoE policy: 28x28 images (one merged token), layer 0 dense, layer 1 MoE, DeepStack; every
  sharded dimension divisible by 2 (hidden 32, 4 heads x 8, 4 experts, vocab 264)."""
  from tars_jax.models import ModelConfig
  base = dict(image_h=28, image_w=28, patch_size=14, vision_hidden=16, vision_depth=1, vision_heads=2,
              vision_mlp=32, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=2,
              moe_intermediate=16, dense_intermediate=32, decoder_sparse_step=2, deepstack_visual_indexes=(0,))
  base.update(kw)
  return ModelConfig(**base)


# --- in-process (1 device) ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, dict(family="qwen2_5_vl", experts=0, deepstack_visual_indexes=(), head_dim=8),
                                dict(tie_word_embeddings=True)])
def test_every_parameter_has_logical_axes(kw):
  cfg = _small_cfg(**kw)
  for cls in (Policy, ValueModel):
    state = nnx.state(nnx.eval_shape(lambda: cls(cfg, nnx.Rngs(0))), nnx.Param)
    for path, var in nnx.to_flat_state(state):
      names = var.get_metadata().get("out_sharding")
      assert names is not None and len(names) == var.value.ndim, (cls.__name__, path, names)
      known = dict(sharding.DEFAULT_RULES)
      assert all(n is None or n in known for n in names), (path, names)
      # model code names no mesh axis ("expert" is also a logical name)
      assert not any(n in ("data", "fsdp", "tensor") for n in names), (path, names)
  moe = nnx.eval_shape(lambda: Policy(cfg, nnx.Rngs(0))).trunk.decoder.layers[1].mlp
  if cfg.experts:
    assert moe.w_gate_up.get_metadata()["out_sharding"] == ("expert", "embed", None, "mlp")


def _moe_loss_and_grads(cfg, x):
  m = MoE(cfg, nnx.Rngs(0))
  gd, st = nnx.split(m)

  def f(st, x):
    y, r = nnx.merge(gd, st)(x)
    return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / y.size), (y, r)

  (loss, (y, r)), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(st, x)
  return loss, y, r, g


def _maxdiff(a, b):
  # on the host: a sharded tree and a committed one-device tree cannot meet in one jitted subtract
  return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
             for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _maxabs(a):
  return max(float(np.max(np.abs(np.asarray(u)))) for u in jax.tree.leaves(a))


# N * k = 540 (blocks of 64 rows), 63 (dense fallback), 6 (< E: per-token gather)
@pytest.mark.parametrize("tokens", [(3, 60), (3, 7), (2, 1)])
def test_grouped_moe_matches_dense_outputs_and_gradients(tokens):
  cfg = _small_cfg(hidden=64, moe_intermediate=48, experts=8, top_k=3)
  x = jax.random.normal(jax.random.PRNGKey(1), tokens + (64,))
  loss_d, y_d, r_d, g_d = _moe_loss_and_grads(cfg, x)
  # ragged dropless, ragged with a capacity no expert can exceed (C = 8 * N * k / E >= N), blocked, grouped
  # (at N * k = 540 its while loop over 64-row chunks, router gradient included)
  for impl, cf in (("ragged", None), ("ragged", 8.0), ("blocked", None), ("grouped", None)):
    loss_r, y_r, r_r, g_r = _moe_loss_and_grads(dataclasses.replace(cfg, moe_impl=impl, moe_capacity_factor=cf), x)
    # float32 rule (`_shared.f32_atol`): router and experts; the loss a tree-reduced sum of mixed-sign
    # terms |.| <= |y| (scale: y's root sum of squares); gradients: back again, plus the N * k rows
    t = 2 * cfg.hidden + cfg.moe_intermediate
    assert float(jnp.max(jnp.abs(y_r - y_d))) <= f32_atol(float(jnp.max(jnp.abs(y_d))), t), impl
    assert abs(float(loss_r - loss_d)) <= f32_atol(float(jnp.sqrt(jnp.sum(y_d ** 2))), t + int(np.log2(y_d.size))), impl
    assert _maxdiff(g_r, g_d) <= f32_atol(_maxabs(g_d), 2 * t + x.size // cfg.hidden * cfg.top_k), impl  # params, input
    assert float(jnp.max(jnp.abs(g_d[0]["w_down"][...]))) > 1e-3  # gradients are not vacuous
    assert float(jnp.max(jnp.abs(g_r[0]["router"]["kernel"][...]))) > 1e-4  # the router's gradient flows
    np.testing.assert_array_equal(r_r[1], r_d[1])
    if cf is not None:
      assert float(r_r[2]) == 0.0


@pytest.mark.parametrize("balanced", [True, False])
def test_bounded_moe_both_branches_equal_dense(balanced):
  """The "blocked" impl's middle regime (decode at batch 16): the [E, C, D] capacity branch when every
  expert's load fits C, the dense branch when one overflows (a zero router sends every token to
  experts 0..k-1); both equal the dense reference in outputs and gradients."""
  from _shared import bounded_moe_case  # here: the 8-device worker process does not need it
  cfg = _small_cfg(hidden=64, moe_intermediate=48, experts=8, top_k=2)
  m, x = bounded_moe_case(cfg, balanced)
  gd, st = nnx.split(m)
  blocked = nnx.merge(nnx.split(MoE(dataclasses.replace(cfg, moe_impl="blocked"), nnx.Rngs(0)))[0], st)

  def loss(mod, x):
    return jnp.sum(jnp.sin(mod(x)[0]))

  (l_d, g_d), (l_b, g_b) = (jax.value_and_grad(loss, argnums=(0, 1))(mod, x) for mod in (m, blocked))
  t = 2 * cfg.hidden + cfg.moe_intermediate  # router, experts (float32 rule as above)
  assert abs(float(l_d - l_b)) <= f32_atol(float(jnp.sqrt(jnp.sum(m(x)[0] ** 2))), t + int(np.log2(x.size)))
  assert _maxdiff(g_d, g_b) <= f32_atol(_maxabs(g_d), 2 * t + x.size // cfg.hidden * cfg.top_k)


_ROUTINGS = (st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 16))


@settings(max_examples=8, deadline=None)
@given(*_ROUTINGS)
def test_block_bound_holds_for_any_routing(sizes, rows):
  """`num_blocks` bounds the blocks any routing needs (the blocked path's static buffer never overflows),
  and the blocked path's block table and the grouped loop's chunk counts cover every assignment."""
  check_block_bound(sizes, rows)


@pytest.mark.long
@settings(max_examples=100, deadline=None)
@given(*_ROUTINGS)
def test_block_bound_holds_for_many_more_routings(sizes, rows):
  """The same property over 100 more routings (~0.6-0.8 s each: the block table is traced per shape)."""
  check_block_bound(sizes, rows)


def check_block_bound(sizes, rows):
  from test_moe_grouped import check_chunk_table
  g = sum(sizes)
  if g == 0:
    return
  need = sum(-(-s // rows) for s in sizes)
  assert need <= moe.num_blocks(g, len(sizes), rows)
  check_chunk_table(sizes, rows)
  chosen = moe.block_rows(g, len(sizes))
  assert chosen == 0 or chosen == 1 or chosen >= moe.MIN_BLOCK_ROWS // 2  # 0 = dense, 1 = gather


def _capacity_reference(flat, w, idx, wgu, wd, c, shards=1):
  """numpy MoE with capacity: tokens [N, D] cut into `shards` contiguous groups (a mesh's token
  shards); within each group, assignments in (token, slot) order, each expert keeps its first `c`.
  Returns (y [N, D], dropped count)."""
  n, k = idx.shape
  wg, wu = wgu[:, :, 0], wgu[:, :, 1]
  want = np.zeros_like(flat)
  n_drop = 0
  for part in np.split(np.arange(n), shards):
    used = np.zeros(wgu.shape[0], int)
    for t in part:
      for s in range(k):
        ex = idx[t, s]
        if used[ex] >= c:
          n_drop += 1
          continue
        used[ex] += 1
        a = flat[t] @ wg[ex]
        h = a / (1 + np.exp(-a)) * (flat[t] @ wu[ex])
        want[t] += w[t, s] * (h @ wd[ex])
  return want, n_drop


def _routed(m, flat):
  """(w [N, k], idx [N, k], w_gate_up, w_down) of MoE `m` on tokens flat [N, D], as numpy."""
  _, w, idx = jax.jit(route, static_argnums=(1, 2))(jnp.asarray(flat) @ m.router.kernel[...], m.top_k, True)
  return np.asarray(w), np.asarray(idx), np.asarray(m.w_gate_up[...]), np.asarray(m.w_down[...])


def test_capacity_factor_drops_like_numpy_reference():
  cfg = _small_cfg(moe_impl="ragged", moe_capacity_factor=0.5)
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (2, 9, 32)))
  m = MoE(cfg, nnx.Rngs(3))
  y, (probs, idx, dropped) = nnx.jit(lambda m, x: m(x))(m, jnp.asarray(x))
  # numpy reference: assignments in (token, slot) order; each expert keeps its first C
  n, k, e = 18, cfg.top_k, cfg.experts
  c = capacity(n, k, e, 0.5)
  assert c == 5  # ceil(0.5 * 18 * 2 / 4)
  flat = x.reshape(n, -1)
  want, n_drop = _capacity_reference(flat, *_routed(m, flat), c)
  assert n_drop > 0 and float(dropped) == n_drop
  assert_close_f32(np.asarray(y).reshape(n, -1), want, terms=2 * cfg.hidden + cfg.moe_intermediate)
  # through the policy: the dropped count of every MoE layer is reported
  pol = Policy(cfg, nnx.Rngs(0))
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(9), (3, 2, 9))
  logits, aux, _, stats = nnx.jit(lambda p, *a: p(*a, moe_stats=True))(pol, toks, pos, jnp.ones((2, 9), bool))
  assert stats["moe_assignments"] == 1 * 18 * 2 and 0 < float(stats["moe_dropped"]) <= 36


def test_config_and_rule_errors():
  with pytest.raises(ValueError, match="moe_impl"):
    _small_cfg(moe_impl="sparse")
  with pytest.raises(ValueError, match="ragged"):
    _small_cfg(moe_capacity_factor=1.0)
  with pytest.raises(ValueError, match="moe_dispatch"):
    _small_cfg(moe_impl="ragged", moe_dispatch="ring")
  with pytest.raises(ValueError, match="needs moe_impl='ragged'"):
    _small_cfg(moe_impl="grouped", moe_dispatch="all_to_all")
  with pytest.raises(sharding.ShardingError, match="unknown mesh axis 'model'"):
    sharding.make_rules({"embed": "model"})
  with pytest.raises(sharding.ShardingError, match="needs 16 devices"):
    sharding.make_mesh((2, 2, 2, 2))
  rules = dict(sharding.make_rules({"embed": None, "mlp": ("tensor", "fsdp")}))
  assert rules["embed"] == () and rules["mlp"] == ("tensor", "fsdp") and rules["vocab"] == ("tensor",)


@pytest.mark.long
@pytest.mark.parametrize("impl", ["ragged", "blocked", "grouped"])
def test_grouped_moe_keeps_transformers_parity(tmp_path, impl):
  import torch  # installed by scripts/setup.sh: a missing torch fails, never skips
  from transformers import AutoModelForImageTextToText
  from test_hf_parity import _check, _hf_config, _inputs
  from tars_jax.models.interop import hf_io
  torch.manual_seed(0)
  hf = AutoModelForImageTextToText.from_config(_hf_config("qwen3_vl_moe")).eval()
  hf.save_pretrained(str(tmp_path))
  ours = hf_io.load_pretrained(str(tmp_path), image_h=56, image_w=84, moe_impl=impl)
  assert ours.cfg.moe_impl == impl
  rng = np.random.default_rng(0)
  pair = (hf, ours, str(tmp_path))
  _check(pair, *_inputs(pair, rng, [[], [(56, 84)]])[:4])


# --- 8 simulated devices (subprocess) ----------------------------------------------------------------

def _run_worker(out):
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.abspath(__file__), str(out)]
  p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
  """The worker run (one process for every 8-device test): each MoE implementation on its meshes, with a
  policy step each."""
  return _run_worker(tmp_path_factory.mktemp("mesh") / "results.json")


MESHES = ["8,1,1,1", "2,2,2,1", "2,1,2,2"]


def _check_run(r):
  assert r["n_devices"] == 8
  assert r["loss_diff"] <= TOL, r
  b, t = 8, 12  # `_batch` of `_small_cfg()` in the worker; gradients: forward, backward, the rows summed
  assert r["grad_max_diff"] <= f32_atol(r["grad_max_abs"], 2 * forward_terms(_small_cfg(), t) + b * t), r
  assert r["grad_max_abs"] > 1e-3  # the gradients compared are not all ~0
  # (the gradients' layout is the compiler's choice in a bare value_and_grad; the step below keeps
  # the parameters' layout)
  assert r["step_params_sharded_like_rules"] == [] and r["step_pg_loss_diff"] <= TOL, r
  # activation constraints (Shardy text): logits [B, T, V] over (batch axes, -, tensor), hidden states
  # [B, T, D] over the batch axes
  cons = "\n".join(r["constraints"])
  assert '[{"data", "fsdp", "expert"}, {}, {"tensor"}]' in cons, cons
  assert '[{"data", "fsdp", "expert"}, {}, {}]' in cons, cons


@pytest.mark.long
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_train_step_on_every_mesh_equals_single_device(mesh_results, mesh, impl):
  _check_run(mesh_results["runs"][f"{impl}@{mesh}"])


@pytest.mark.long  # the 8-device worker run (one per module) takes ~250 s
def test_all_to_all_dispatch_train_step_equals_single_device(mesh_results):
  """moe_dispatch="all_to_all" on (2, 1, 2, 2): loss and gradients as one device, and the compiled
  step really exchanges tokens: forward dispatch (rows, expert ids) and return, and their transposes."""
  r = mesh_results["runs"]["a2a@2,1,2,2"]
  _check_run(r)
  assert r["collectives"]["all-to-all"] == 5, r["collectives"]
  assert mesh_results["runs"]["ragged@2,1,2,2"]["collectives"]["all-to-all"] == 0


@pytest.mark.long  # the 8-device worker run (one per module) takes ~250 s
def test_all_to_all_dispatch_only_where_tokens_split_over_experts(mesh_results):
  r = mesh_results["a2a_shapes"]
  assert all(diff <= TOL for diff, _ in r.values()), r
  # 8 tokens split over (data, fsdp, expert): one forward dispatch (rows + ids) and return per MoE
  # layer of the scanned body; 1 and 15 tokens do not split over `expert`: the single-shard path
  assert r["2x4"][1] >= 2 and r["1x1"][1] == 0 and r["3x5"][1] == 0, r


@pytest.mark.long  # the 8-device worker run (one per module) takes ~250 s
def test_all_to_all_capacity_drops_per_shard_like_numpy_reference(mesh_results):
  r = mesh_results["a2a_capacity"]
  assert r["cf0.5"]["c"] == 2 and r["cf0.5"]["want_dropped"] > 0  # ceil(0.5 * 6 * 2 / 4)
  for name in ("cf0.5", "cf8"):
    assert r[name]["dropped"] == r[name]["want_dropped"], r
    assert r[name]["y_diff"] <= TOL and r[name]["y_max"] > 0.1, r
  assert r["cf8"]["want_dropped"] == 0
  assert r["mlp_error"].startswith("ShardingError") and "'mlp' rule's mesh axes ('data',)" in r["mlp_error"], r


@pytest.mark.long
def test_all_to_all_dispatch_with_fsdp_and_four_expert_shards(mesh_results):
  """(1, 2, 1, 4): one expert per shard, expert weights all-gathered over fsdp inside the shard_map."""
  r = mesh_results["runs"]["a2a@1,2,1,4"]
  _check_run(r)
  assert r["collectives"]["all-to-all"] >= 5, r["collectives"]  # + the compiler's own reshards here


@pytest.mark.long
def test_blocked_moe_train_step_on_expert_parallel_mesh(mesh_results):
  _check_run(mesh_results["runs"]["blocked@2,1,2,2"])


def _shard(shape, mesh, spec):
  sizes = dict(zip(("data", "fsdp", "tensor", "expert"), mesh))
  out = []
  for d, s in zip(shape, spec):
    axes = () if s is None else (s if isinstance(s, list) else [s])
    out.append(d // int(np.prod([sizes[a] for a in axes])) if axes else d)
  return out


@pytest.mark.long  # the 8-device worker run (one per module) takes ~250 s
def test_parameters_distributed_as_rules_say(mesh_results):
  _check_params(mesh_results["runs"]["ragged@2,1,2,2"]["params"], "2,1,2,2")


@pytest.mark.long
@pytest.mark.parametrize("mesh", MESHES)
def test_parameters_distributed_as_rules_say_on_every_mesh(mesh_results, mesh):
  _check_params(mesh_results["runs"][f"dense@{mesh}"]["params"], mesh)


def _check_params(got, mesh):
  m = tuple(int(x) for x in mesh.split(","))
  # path -> (global shape, logical axes -> default rules by hand)
  want = {
      "['trunk']['decoder']['layers'][1]['mlp']['w_gate_up']": ([4, 32, 2, 16], ["expert", "fsdp", None, "tensor"]),
      "['trunk']['decoder']['layers'][1]['mlp']['w_down']": ([4, 16, 32], ["expert", "tensor", "fsdp"]),
      "['trunk']['decoder']['layers'][0]['mlp']['gate_proj']['kernel']": ([32, 32], ["fsdp", "tensor"]),
      "['trunk']['decoder']['layers'][0]['self_attn']['k_proj']['kernel']": ([32, 16], ["fsdp", "tensor"]),
      "['trunk']['embed_tokens']['embedding']": ([264, 32], ["tensor", "fsdp"]),
      "['lm_head']['kernel']": ([32, 264], ["fsdp", "tensor"]),
      "['trunk']['visual']['blocks'][0]['attn']['qkv']['kernel']": ([16, 48], ["fsdp", "tensor"]),
      "['trunk']['decoder']['layers'][1]['mlp']['router']['kernel']": ([32, 4], ["fsdp", None]),
      "['trunk']['decoder']['norm']['scale']": ([32], [None]),
  }
  for path, (shape, spec) in want.items():
    g_shape, g_spec, g_shard = got[path]
    assert g_shape == shape and g_spec == spec, (path, got[path])
    assert g_shard == _shard(shape, m, spec), (path, got[path])
  if m == (2, 1, 2, 2):  # experts really split: each device holds 2 of the 4 experts, half their width
    assert got["['trunk']['decoder']['layers'][1]['mlp']['w_gate_up']"][2] == [2, 32, 2, 8]


@pytest.mark.long  # the 8-device worker run (one per module) takes ~250 s
def test_indivisible_dimension_is_a_typed_error(mesh_results):
  msg = mesh_results["indivisible_error"]
  assert msg.startswith("ShardingError")
  for part in ("['lm_head']['kernel']", "rule 'vocab'", "mesh axis 'tensor' of size 8", "dimension 1 of size 260"):
    assert part in msg, msg


@pytest.mark.long  # the 8-device worker run (one per module) takes ~250 s
def test_load_pretrained_places_tensors_by_rules(mesh_results):
  r = mesh_results["hf_io"]
  assert r["values_equal"] and r["logits_diff"] <= TOL
  assert r["w_gate_up"] == [[4, 32, 2, 16], ["expert", "fsdp", None, "tensor"], [2, 32, 2, 8]]
  assert r["embed"] == [[264, 32], ["tensor", "fsdp"], [132, 32]]


@pytest.mark.long  # the 8-device worker run (one per module) takes ~250 s
def test_trainer_state_on_mesh_from_config(mesh_results):
  r = mesh_results["state"]
  assert r["mesh"] == [2, 1, 2, 2] and r["default_mesh"]
  # smoke model: 4 experts, hidden 64, moe_intermediate 64; embed -> None by the config override
  assert r["policy_w_gate_up"] == [[4, 64, 2, 64], ["expert", None, None, "tensor"], [2, 64, 2, 32]]
  assert r["critic_embed"] == [[264, 64], ["tensor", None], [132, 64]]
  assert r["opt_mu_w_gate_up"] and all(s == ["expert", None, None, "tensor"]
                                       for s in r["opt_mu_w_gate_up"])  # Adam mu, nu
  assert r["init_max_diff"] <= 1e-6  # same initial values as the one-device init


# --- the 8-device worker -----------------------------------------------------------------------------

def _grpo_hp(cfg, aux_loss_coef=0.01, ent_coef=0.0):
  """PPOHparams of a critic-free update of `cfg`'s model: the smoke config's, with the fields these tests
  depend on set here (a new PPOHparams field gets its default from the config)."""
  from experiments.configs import miniwob_ppo
  from tars_jax.train import state as state_lib
  return dataclasses.replace(
      state_lib.hparams(miniwob_ppo.get_config("smoke")), algo="grpo", gamma=1.0, whiten_advantages=True,
      clip_low=0.2, clip_high=0.28, clip_c=None, ent_coef=ent_coef, aux_loss_coef=aux_loss_coef,
      loss_agg="token-mean", kl_coef=0.0, decoupled=False, behaviour_weight_cap=None, top_entropy_frac=1.0,
      ptx_coef=0.0, temperature=1.0)


def _inputs(cfg):
  from tars_jax.train.step import ModelInputs
  return ModelInputs(cfg.image_token_id, tuple(cfg.merged_grid))


def _batch(cfg, b=8, t=12, seed=0):
  from tars_jax.agent.tokenizer import BOS
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, 256, (b, t)).astype(np.int32)
  toks[:, 0] = BOS
  toks[:, 2] = cfg.image_token_id  # one merged image token per row
  mask = np.ones((b, t), bool)
  mask[1, :3] = False  # left padding in one row
  loss_mask = np.zeros((b, t - 1), np.float32)
  loss_mask[:, 4:] = 1.0
  return dict(tokens=toks, attn_mask=mask, pixel_values=rng.random((b, 1, cfg.image_h, cfg.image_w, 3)).astype(np.float32),
              image_mask=np.ones((b, 1), bool), loss_mask=loss_mask,
              old_logp=(-6.0 + 0.3 * rng.standard_normal((b, t - 1))).astype(np.float32),
              advantages=(rng.standard_normal((b, t - 1)) * loss_mask).astype(np.float32),
              states=np.zeros((b, t - 1), np.int32))


def _worker(out_path):
  """Writes the results JSON: the dense and ragged MoE on all MESHES, the blocked MoE and all-to-all
  dispatch on their meshes, each with a `ppo.policy_step`; then the single-purpose checks."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  from tars_jax import sharding
  from tars_jax.models import Policy
  from tars_jax.models.interop import hf_io
  from tars_jax.models.interop.hf_model import HFModel
  from tars_jax.train import ppo
  from tars_jax.train import step as step_lib

  assert jax.device_count() == 8, jax.devices()
  spec_json = lambda s: [list(a) if isinstance(a, tuple) else a for a in s]
  results = {"runs": {}}
  cfg = _small_cfg()
  gd, params = nnx.split(Policy(cfg, nnx.Rngs(0)))
  hp, inputs = _grpo_hp(cfg, aux_loss_coef=0.1, ent_coef=0.01), _inputs(cfg)
  popt = ppo.make_optimizer(1e-3, 1, 1.0, 0.0)
  batch = {k: jnp.asarray(v) for k, v in _batch(cfg).items()}

  def loss_grad(gd_):
    return jax.jit(lambda p, mb: jax.value_and_grad(ppo.policy_loss, has_aux=True)(p, gd_, None, mb, hp, inputs))

  t0 = time.time()
  (ref_loss, ref_m), ref_g = loss_grad(gd)(params, batch)
  print(f"reference loss/grad {time.time() - t0:.1f}s", flush=True)
  ref_state = {"step": jnp.zeros((), jnp.int32), "policy": params, "policy_opt": popt.init(params)}
  _, ref_step_m = ppo.policy_step(jax.tree.map(jnp.copy, ref_state), batch, None, policy_gd=gd, popt=popt, hp=hp, inputs=inputs)
  runs = ([(i, m) for i in ("dense", "ragged") for m in MESHES]
          + [("blocked", "2,1,2,2"), ("a2a", "2,1,2,2"), ("a2a", "1,2,1,4")])
  for impl, mesh_s in runs:
    kw = dict(moe_impl="ragged", moe_dispatch="all_to_all") if impl == "a2a" else dict(moe_impl=impl)
    mesh = sharding.make_mesh(tuple(int(x) for x in mesh_s.split(",")))
    rules = sharding.make_rules()
    with sharding.activate(mesh, rules):  # built under its mesh: the MoE strategy is chosen for it
      gd_i = nnx.split(nnx.eval_shape(lambda: Policy(dataclasses.replace(cfg, **kw), nnx.Rngs(0))))[0]
    p_sh = sharding.shard(jax.tree.map(jnp.copy, params), mesh, rules)  # a copy: the step donates it
    mb = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    want_sh = sharding.logical_to_sharding(params, mesh, rules)
    described = {k: [list(s), spec_json(sp), list(sh)] for k, (s, sp, sh) in sharding.describe(p_sh).items()}
    t0 = time.time()
    with sharding.activate(mesh, rules):
      compiled = loss_grad(gd_i).lower(p_sh, mb).compile()  # compiled once: run, and its HLO read
      (loss, _), g = compiled(p_sh, mb)
      t1 = time.time()
      collectives = {op: compiled.as_text().count(f" {op}(") for op in ("all-to-all",)}
      # the activation constraints as lowered (Shardy): logits [B, T, V] over (batch axes, -, tensor)
      hlo = jax.jit(lambda p, mb: nnx.merge(gd_i, p)(
          mb["tokens"], step_lib.positions(mb["tokens"], mb["attn_mask"], inputs), mb["attn_mask"], mb["pixel_values"],
          mb["image_mask"])[0]).lower(p_sh, mb).as_text()
      state = {"step": jnp.zeros((), jnp.int32), "policy": p_sh, "policy_opt": jax.jit(popt.init)(p_sh)}
      new, step_m = ppo.policy_step(state, mb, None, policy_gd=gd_i, popt=popt, hp=hp, inputs=inputs)
      print(f"{impl}@{mesh_s}: loss/grad {t1 - t0:.1f}s, step {time.time() - t1:.1f}s", flush=True)
    def same_sh(tree):  # paths whose sharding differs from the rules' ([] = all as the rules say)
      got = jax.tree_util.tree_leaves_with_path(tree)
      return [f"{jax.tree_util.keystr(p)}: {a.sharding.spec} != {s.spec}" for (p, a), s in
              zip(got, jax.tree.leaves(want_sh)) if not a.sharding.is_equivalent_to(s, a.ndim)]
    results["runs"][f"{impl}@{mesh_s}"] = dict(
        n_devices=len(mesh.devices.flat), loss_diff=abs(float(loss - ref_loss)), grad_max_diff=_maxdiff(g, ref_g),
        grad_max_abs=max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref_g)),
        grads_sharded_like_params=same_sh(g),
        step_params_sharded_like_rules=same_sh(new["policy"]),
        step_pg_loss_diff=abs(float(step_m["pg_loss"] - ref_step_m["pg_loss"])),
        constraints=[line.strip()[:300] for line in hlo.splitlines() if "sharding_constraint" in line],
        params=described, collectives=collectives)
  results["a2a_capacity"] = _a2a_capacity_run(cfg)
  results["a2a_shapes"] = _a2a_shapes_run(cfg)
  # a mesh axis that does not divide a dimension
  mesh8 = sharding.make_mesh((1, 1, 8, 1))
  try:
    sharding.logical_to_sharding(nnx.state(nnx.eval_shape(lambda: Policy(_small_cfg(vocab_size=260), nnx.Rngs(0)))),
                                 mesh8)
    results["indivisible_error"] = "no error"
  except sharding.ShardingError as e:
    results["indivisible_error"] = f"ShardingError: {e}"
  # transformers checkpoint -> sharded model
  import tempfile
  hcfg = _small_cfg(image_h=56, image_w=56, temporal_patch_size=2)
  model = HFModel(hcfg, nnx.Rngs(1))
  with tempfile.TemporaryDirectory() as d:
    hf_io.save_pretrained(model, d)
    mesh = sharding.make_mesh((2, 1, 2, 2))
    loaded = hf_io.load_pretrained(d, mesh=mesh, image_h=56, image_w=56)
    plain = hf_io.load_pretrained(d, image_h=56, image_w=56)
  flat = lambda m: {tuple(p): v[...] for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
  a, b = flat(loaded), flat(plain)
  ids = np.random.default_rng(0).integers(0, 256, (2, 6))
  desc = sharding.describe(nnx.state(loaded, nnx.Param))
  pick = lambda key: [list(desc[key][0]), spec_json(desc[key][1]), list(desc[key][2])]
  results["hf_io"] = dict(
      values_equal=all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in b),
      logits_diff=float(np.max(np.abs(np.asarray(loaded(ids)) - np.asarray(plain(ids))))),
      w_gate_up=pick("['policy']['trunk']['decoder']['layers'][1]['mlp']['w_gate_up']"),
      embed=pick("['policy']['trunk']['embed_tokens']['embedding']"))
  # trainer state creation behind config.mesh
  import ml_collections as mlc
  from experiments.configs import miniwob_ppo
  from tars_jax.train import state as state_lib
  c = miniwob_ppo.get_config("smoke")
  c.mesh = mlc.ConfigDict({"shape": (2, 1, 2, 2), "rules": {"embed": None}})  # FSDP off by override
  parts = state_lib.build(c)
  st = parts.init_state(0)
  parts0 = state_lib.build(miniwob_ppo.get_config("smoke"))
  st0 = parts0.init_state(0)
  d = {**{"policy" + k: v for k, v in sharding.describe(st["policy"]).items()},
       **{"opt" + k: v for k, v in sharding.describe(st["policy_opt"]).items()},
       **{"critic" + k: v for k, v in sharding.describe(st["critic"]).items()}}
  w = "['trunk']['decoder']['layers'][0]['mlp']['w_gate_up']"
  results["state"] = dict(
      mesh=list(sharding.mesh_shape(parts.mesh)), default_mesh=parts0.mesh is None,
      policy_w_gate_up=[list(d["policy" + w][0]), spec_json(d["policy" + w][1]), list(d["policy" + w][2])],
      critic_embed=[list(x) if isinstance(x, tuple) else spec_json(x)
                    for x in d["critic['trunk']['embed_tokens']['embedding']"]],
      opt_mu_w_gate_up=[spec_json(v[1]) for k, v in d.items() if k.startswith("opt") and k.endswith(w)],
      init_max_diff=_maxdiff(st["policy"], st0["policy"]) if jax.tree.structure(st["policy"]) ==
      jax.tree.structure(st0["policy"]) else "structure differs")
  with open(out_path, "w") as f:
    json.dump(results, f)


def _a2a_shapes_run(cfg):
  """Logits of a scanned-layer policy with moe_dispatch="all_to_all" on (2, 1, 2, 2) minus one device's,
  for token counts that split over the expert axis (2 x 4: all-to-all) and that do not (1 x 1, the
  decode of one sequence; 3 x 5): {"BxT": [max abs diff, all-to-all ops in the compiled forward]}."""
  from tars_jax import sharding
  cfg = dataclasses.replace(cfg, moe_impl="ragged", scan_layers=True, decoder_sparse_step=1)
  gd, st = nnx.split(Policy(cfg, nnx.Rngs(0)))
  gd2 = nnx.split(Policy(dataclasses.replace(cfg, moe_dispatch="all_to_all"), nnx.Rngs(0)))[0]
  mesh, rules = sharding.make_mesh((2, 1, 2, 2)), sharding.make_rules()
  out = {}
  for b, t in ((2, 4), (1, 1), (3, 5)):
    toks = jax.random.randint(jax.random.PRNGKey(0), (b, t), 0, 256)
    pos = jnp.broadcast_to(jnp.arange(t), (3, b, t))
    f = jax.jit(lambda st, g: nnx.merge(g, st)(toks, pos, jnp.ones((b, t), bool))[0], static_argnums=1)
    ref = f(st, gd)
    with sharding.activate(mesh, rules):
      st_sh = sharding.shard(st, mesh, rules)
      compiled = f.lower(st_sh, gd2).compile()
      got = compiled(st_sh)  # the static graphdef is part of the compiled program
      n_a2a = compiled.as_text().count(" all-to-all(")
    out[f"{b}x{t}"] = [float(jnp.max(jnp.abs(got - ref))), n_a2a]
  return out


def _a2a_capacity_run(cfg):
  """The all-to-all MoE with capacity factor 0.5 on the (2, 2, 1, 2) mesh (8 token shards of 6 tokens)
  against `_capacity_reference` with per-shard capacity; and dropless with a capacity no shard can
  exceed. Returns the differences and drop counts."""
  from tars_jax import sharding
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (8, 6, cfg.hidden)))
  flat = x.reshape(48, -1)
  mesh, rules = sharding.make_mesh((2, 2, 1, 2)), sharding.make_rules()
  out = {}
  for name, cf in (("cf0.5", 0.5), ("cf8", 8.0)):
    m = MoE(dataclasses.replace(cfg, moe_impl="ragged", moe_dispatch="all_to_all", moe_capacity_factor=cf),
            nnx.Rngs(3))
    gd, st = nnx.split(m)
    with sharding.activate(mesh, rules):
      y, (_, _, dropped) = jax.jit(lambda st, x: nnx.merge(gd, st)(x))(sharding.shard(st, mesh, rules), jnp.asarray(x))
    c = capacity(6, cfg.top_k, cfg.experts, cf)  # per (token shard, expert)
    want, n_drop = _capacity_reference(flat, *_routed(m, flat), c, shards=8)
    out[name] = dict(c=c, dropped=float(dropped), want_dropped=n_drop,
                     y_diff=float(np.max(np.abs(np.asarray(y).reshape(48, -1) - want))),
                     y_max=float(np.max(np.abs(want))))
  # the expert width ("mlp") split over a token axis: partial sums would mix tokens -> typed error
  bad = sharding.make_rules({"mlp": "data"})
  try:
    with sharding.activate(mesh, bad):
      jax.jit(lambda st, x: nnx.merge(gd, st)(x))(sharding.shard(st, mesh, bad), jnp.asarray(x))
    out["mlp_error"] = "no error"
  except sharding.ShardingError as e:
    out["mlp_error"] = f"ShardingError: {e}"
  return out


if __name__ == "__main__":
  _worker(sys.argv[1])


@pytest.mark.long  # ~40 s
def test_ppo_metrics_report_the_fraction_of_moe_assignments_dropped():
  from tars_jax.train import ppo
  from tars_jax.train import step as step_lib
  for factor in (0.5, None):
    cfg = _small_cfg(moe_impl="ragged", moe_capacity_factor=factor)
    gd, params = nnx.split(Policy(cfg, nnx.Rngs(0)))
    hp, inputs = _grpo_hp(cfg), _inputs(cfg)
    mb = {k: jnp.asarray(v) for k, v in _batch(cfg).items()}
    _, m = jax.jit(lambda p: ppo.policy_loss(p, gd, None, mb, hp, inputs))(params)
    pol = nnx.merge(gd, params)
    pos = step_lib.positions(mb["tokens"], mb["attn_mask"], inputs)
    *_, st = pol(mb["tokens"], pos, mb["attn_mask"], mb["pixel_values"], mb["image_mask"], moe_stats=True)
    # 8 rows x 12 tokens x top-2 in the one MoE layer
    assert float(st["moe_assignments"]) == 8 * 12 * 2
    want = float(st["moe_dropped"]) / (8 * 12 * 2)
    assert (want > 0) == (factor is not None)
    np.testing.assert_allclose(float(m["moe_dropped_frac"]), want, rtol=1e-6)
