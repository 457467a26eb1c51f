"""Scanned decoder layers and vision blocks (`ModelConfig.scan_layers`): the stacked, `lax.scan`-ned
decoder and ViT are the same function as the unrolled ones.

With the same weights (the unscanned parameters stacked by `decoder.stack_layer_arrays`): logits
within 1e-5 (float32), the same MoE aux loss and `moe_stats`, and the same gradients (unstacked
back per layer / block) for qwen3_vl_moe (MoE layers; 3 vision blocks with DeepStack taken after
blocks 0 and 2 and added after decoder layers 0 and 1) and qwen2_5_vl (dense Qwen2 layers with
biases; 3 vision blocks, window attention in blocks 0 and 2, full attention in block 1, a window
mask that changes the output), with remat "none" / "full" / "dots". A transformers checkpoint
loads into the stacked layout (`load_pretrained(..., scan_layers=True)`), greedy KV-cache decoding
gives transformers `generate`'s tokens, and `save_pretrained` writes a directory transformers
loads to our logits. On 8 simulated CPU devices (subprocess) the scanned loss and gradients on mesh
(2, 1, 2, 2) equal the single-device ones.
"""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax import sharding
from tars_jax.models import ModelConfig, Policy
from tars_jax.models.decoder import init_cache, stack_layer_arrays, unstack_layer_arrays
from _shared import f32_atol, forward_terms, vision_terms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5
LAYERS = ("trunk", "decoder", "layers")
BLOCKS = ("trunk", "visual", "blocks")


def _cfg(family, **kw):
  """Tiny 3-layer model of `family` on 56x56 images (4 merged tokens per image), 3 vision blocks
  (qwen3_vl_moe: DeepStack after blocks 0 and 2; qwen2_5_vl: windows of one merged token, i.e. 4
  windows per image, full attention in block 1)."""
  base = dict(image_h=56, image_w=56, vision_hidden=32, vision_depth=3, vision_heads=2, vision_mlp=64,
              hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2, moe_intermediate=32,
              dense_intermediate=96, deepstack_visual_indexes=(0, 2))
  if family == "qwen2_5_vl":
    base.update(family=family, experts=0, deepstack_visual_indexes=(), window_size=28, fullatt_block_indexes=(1,))
  base.update(kw)
  return ModelConfig(**base)


def _flat(state):
  """{path: numpy array} (numpy: comparisons without compiling an op per parameter shape)."""
  return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def _policy(cfg, seed=0):
  """`Policy(cfg, nnx.Rngs(seed))`, initialised in one jitted call (eager init compiles every op)."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Policy(cfg, nnx.Rngs(seed))))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.split(Policy(cfg, nnx.Rngs(seed)))[1])())


def _scanned_copy(model):
  """A `scan_layers=True` twin of `model` holding `model`'s parameters stacked (its abstract state
  filled with them), so any difference below is the scan's."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Policy(dataclasses.replace(model.cfg, scan_layers=True),
                                                            nnx.Rngs(1))))
  stacked = stack_layer_arrays(_flat(nnx.state(model, nnx.Param)))
  flat = nnx.to_flat_state(state)
  assert {tuple(p) for p, _ in flat} == set(stacked)
  for p, v in flat:
    assert v.get_value().shape == stacked[tuple(p)].shape, p
    v.set_value(jnp.asarray(stacked[tuple(p)]))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _batch(cfg, b=2, t=20, seed=0):
  """Left-padded rows with one image (its merged tokens at 3..) and rope positions as the trainer's."""
  from tars_jax.models import rope_positions
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, 256, (b, t)).astype(np.int32)
  n = cfg.n_img_tokens
  toks[:, 3:3 + n] = cfg.image_token_id
  mask = np.ones((b, t), bool)
  mask[0, :2] = False
  toks, mask = jnp.asarray(toks), jnp.asarray(mask)
  pos = rope_positions(toks, mask, cfg.image_token_id, cfg.merged_grid)
  pix = jnp.asarray(rng.random((b, 1, cfg.image_h, cfg.image_w, 3)), jnp.float32)
  return toks, pos, mask, pix


def _loss(model, toks, pos, mask, pix):
  """Next-token cross-entropy over real tokens + 0.1 * aux (so the router gets gradients too)."""
  logits, aux, _, stats = model(toks, pos, mask, pix, moe_stats=True)
  logp = jax.nn.log_softmax(logits[:, :-1], -1)
  nll = -jnp.take_along_axis(logp, toks[:, 1:, None], -1)[..., 0]
  w = mask[:, 1:].astype(jnp.float32)
  return jnp.sum(nll * w) / jnp.sum(w) + 0.1 * aux, (logits, aux, stats)


@pytest.mark.parametrize("family,remat,moe", [
    pytest.param("qwen3_vl_moe", "dots", dict(moe_impl="ragged", moe_capacity_factor=0.5), marks=pytest.mark.long),
    pytest.param("qwen2_5_vl", "full", {}, marks=pytest.mark.long),
    pytest.param("qwen3_vl_moe", "none", {}, marks=pytest.mark.long),
    pytest.param("qwen2_5_vl", "none", {}, marks=pytest.mark.long),
    pytest.param("qwen3_vl_moe", "full", {}, marks=pytest.mark.long),
])
def test_scanned_equals_unscanned_logits_aux_and_grads(family, remat, moe):
  cfg = _cfg(family, remat=remat, **moe)
  ref = _policy(cfg)
  scn = _scanned_copy(ref)
  batch = _batch(cfg)
  step = nnx.jit(lambda m, *b: nnx.value_and_grad(_loss, has_aux=True)(m, *b))
  (l0, (lg0, aux0, st0)), g0 = step(ref, *batch)
  (l1, (lg1, aux1, st1)), g1 = step(scn, *batch)
  m = np.asarray(batch[2])
  assert np.abs(np.asarray(lg0)[m]).max() > 0.5  # logits far from 0: the comparison is not vacuous
  terms = forward_terms(cfg, m.shape[1])  # float32 rule (`_shared.f32_atol`); the loss: a mean of -log p > 0
  assert float(np.abs(np.asarray(lg0) - np.asarray(lg1))[m].max()) <= f32_atol(np.abs(np.asarray(lg0)[m]).max(), terms)
  assert abs(float(l0) - float(l1)) <= f32_atol(abs(float(l0)), terms)
  assert abs(float(aux1) - float(aux0)) <= f32_atol(abs(float(aux0)), cfg.hidden + m.size)  # router, tokens
  if family == "qwen3_vl_moe":
    assert float(aux0) > 0.5  # 3 MoE layers' load-balance loss (1 * top_k for a uniform router)
  assert float(st1["moe_assignments"]) == float(st0["moe_assignments"])
  assert float(st1["moe_dropped"]) == float(st0["moe_dropped"])
  if moe.get("moe_capacity_factor"):
    assert float(st0["moe_dropped"]) > 0  # the capacity really drops some assignments
  f0, f1 = _flat(g0), _flat(g1)
  u1 = unstack_layer_arrays(f1, {p for p in f1 if p[:3] in (LAYERS, BLOCKS)})
  assert set(u1) == set(f0)
  err = max(float(np.abs(f0[p] - u1[p]).max()) for p in f0)
  assert err <= f32_atol(max(float(np.abs(g).max()) for g in f0.values()), 2 * terms + m.size), err  # + rows
  assert max(float(np.abs(g).max()) for g in f0.values()) > 1e-3  # gradients are not all ~0
  for i in range(cfg.vision_depth):  # every vision block gets a gradient (none is skipped by the scan)
    assert float(np.abs(f0[BLOCKS[:3] + (i, "attn", "qkv", "kernel")]).max()) > 1e-4, i


@pytest.mark.long  # ~25 s
def test_window_and_full_attention_blocks_differ_in_the_scanned_vit():
  """The qwen2_5_vl case above is not vacuous: with every block full-attention the scanned ViT's
  output changes (so the per-block window / full switch really selects different masks), and the
  scanned ViT with full attention everywhere still equals its unscanned twin."""
  cfg = _cfg("qwen2_5_vl")
  pix = jnp.asarray(np.random.default_rng(1).random((2, 56, 56, 3)), jnp.float32)
  enc = lambda m: np.asarray(nnx.jit(lambda m, p: m.trunk.visual.encode(p))(m, pix))
  ref = _policy(cfg)
  scn = _scanned_copy(ref)
  full = dataclasses.replace(cfg, fullatt_block_indexes=(0, 1, 2))
  ref_full = _policy(full)
  fa, fb = _flat(nnx.state(ref, nnx.Param)), _flat(nnx.state(ref_full, nnx.Param))
  assert all(np.array_equal(fa[p], fb[p]) for p in fa)  # same seed and structure: same weights
  scn_full = _scanned_copy(ref_full)
  assert np.abs(enc(ref) - enc(scn)).max() <= f32_atol(np.abs(enc(ref)).max(), vision_terms(cfg))
  assert np.abs(enc(ref_full) - enc(scn_full)).max() <= f32_atol(np.abs(enc(ref_full)).max(), vision_terms(full))
  assert np.abs(enc(scn) - enc(scn_full)).max() > 1e-2


def test_stacked_parameters_carry_the_layers_axis():
  cfg = _cfg("qwen3_vl_moe", scan_layers=True)
  state = nnx.state(nnx.eval_shape(lambda: Policy(cfg, nnx.Rngs(0))), nnx.Param)
  seen = 0
  for path, var in nnx.to_flat_state(state):
    names = var.get_metadata()["out_sharding"]
    assert len(names) == var.get_value().ndim, (path, names)
    if tuple(path[:3]) in (LAYERS, BLOCKS):
      seen += 1
      n = cfg.layers if tuple(path[:3]) == LAYERS else cfg.vision_depth
      assert names[0] == "layers" and var.get_value().shape[0] == n, (path, names)
    else:
      assert "layers" not in names, (path, names)
  assert seen >= 20
  qkv = state["trunk"]["visual"]["blocks"]["attn"]["qkv"]["kernel"]
  assert qkv.get_metadata()["out_sharding"] == ("layers", "vision_embed", "vision_heads")
  assert qkv.get_value().shape == (cfg.vision_depth, 32, 96)
  assert dict(sharding.make_rules())["layers"] == ()  # the stacked axis is never sharded
  moe = dict((tuple(p[3:]), v) for p, v in nnx.to_flat_state(state) if tuple(p[:3]) == LAYERS)
  assert moe[("mlp", "w_gate_up")].get_metadata()["out_sharding"] == ("layers", "expert", "embed", None, "mlp")
  assert moe[("mlp", "w_gate_up")].get_value().shape == (3, 4, 64, 2, 32)


def test_mixed_dense_and_moe_layers_cannot_scan():
  with pytest.raises(ValueError, match=r"scan_layers=True needs every decoder layer.*layers \[1\] are dense"):
    _cfg("qwen3_vl_moe", scan_layers=True, mlp_only_layers=(1,))
  with pytest.raises(ValueError, match=r"layers \[0, 2\] are dense.*decoder_sparse_step=2"):
    _cfg("qwen3_vl_moe", scan_layers=True, layers=4, decoder_sparse_step=2)
  _cfg("qwen3_vl_moe", scan_layers=True, mlp_only_layers=(0, 1, 2))  # all dense: one structure, fine


def test_stacked_kv_cache_layout():
  cfg = _cfg("qwen3_vl_moe", scan_layers=True)
  cache = init_cache(cfg, 2, 7)
  assert cache.k.shape == cache.v.shape == (3, 2, cfg.kv_heads, 7, cfg.head_dim)
  assert cache.mask.shape == (2, 7)


# --- transformers checkpoint in / out, greedy decoding --------------------------------------------------

def _hf_model():
  """A tiny transformers Qwen3-VL-MoE, all layers MoE, DeepStack on both vision blocks, visible norms."""
  import torch
  from transformers import AutoModelForImageTextToText
  from test_hf_parity import _hf_config
  cfg = _hf_config("qwen3_vl_moe")  # the parity tests' model, with every layer MoE (scannable)
  cfg.text_config.mlp_only_layers = []
  cfg.vision_config.num_position_embeddings = 16
  torch.manual_seed(0)
  hf = AutoModelForImageTextToText.from_config(cfg).eval()
  with torch.no_grad():
    for _, p in hf.named_parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  return hf


def _prompts(rng, n_rows=2):
  """Left-padded rows BOS text <vs> IMAGE*4 <ve> text (56x56 images); numpy ids, mask, images uint8."""
  from tars_jax.agent.tokenizer import BOS, IMAGE, PAD, VISION_END, VISION_START
  rows, images = [], []
  for _ in range(n_rows):
    images.append(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
    rows.append([BOS] + list(rng.integers(0, 256, rng.integers(2, 9))) + [VISION_START] + [IMAGE] * 4
                + [VISION_END] + list(rng.integers(0, 256, 3)))
  t = max(len(r) for r in rows)
  ids, mask = np.full((n_rows, t), PAD, np.int64), np.zeros((n_rows, t), np.int64)
  for i, r in enumerate(rows):
    ids[i, t - len(r):], mask[i, t - len(r):] = r, 1
  return ids, mask, images


def _hf_pixels(images):
  from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
  proc = Qwen2VLImageProcessorPil(do_resize=False, patch_size=14, temporal_patch_size=2, merge_size=2,
                                  image_mean=[0.5] * 3, image_std=[0.5] * 3)
  out = proc(images=images, return_tensors="np")
  return out["pixel_values"], out["image_grid_thw"]


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
  """(transformers model, its directory, our scanned HFModel loaded from it, our unscanned one)."""
  import torch  # noqa: F401  (installed by scripts/setup.sh: missing fails)
  from tars_jax.models.interop import hf_io
  hf = _hf_model()
  path = str(tmp_path_factory.mktemp("hf_scan"))
  hf.save_pretrained(path)
  return (hf, path, hf_io.load_pretrained(path, image_h=56, image_w=56, scan_layers=True),
          hf_io.load_pretrained(path, image_h=56, image_w=56))


def test_load_pretrained_stacks_layers_and_decodes_like_generate(hf_pair):
  """Stacked parameters equal the unscanned load's per layer; 16 greedy KV-cache tokens of the
  scanned model equal the unscanned model's and transformers `generate`'s (top-2 gaps checked)."""
  from test_hf_parity import hf_greedy
  from tars_jax.agent.tokenizer import PAD
  from tars_jax.models.inference import sampler
  hf, _, scn, ref = hf_pair
  assert scn.cfg.scan_layers and not ref.cfg.scan_layers
  fs, fr = _flat(nnx.state(scn, nnx.Param)), _flat(nnx.state(ref, nnx.Param))
  assert set(stack_layer_arrays(fr)) == set(fs)
  for p, a in stack_layer_arrays(fr).items():
    np.testing.assert_array_equal(np.asarray(fs[p]), np.asarray(a))
  ids, mask, images = _prompts(np.random.default_rng(4))
  pix, grid = _hf_pixels(images)
  n = 16
  want = hf_greedy(hf, ids, mask, pix, grid, n)  # asserts top-2 gaps: an equal sequence is not luck
  imgs = jnp.asarray(np.stack(images)[:, None] / 255.0, jnp.float32)
  for model in (scn, ref):
    gen = sampler.generate(model.policy, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool), imgs, None,
                           jax.random.PRNGKey(0), max_new_tokens=n, temperature=0.0, eos_id=-1, pad_id=PAD)
    np.testing.assert_array_equal(np.asarray(gen.tokens), want)


def test_save_pretrained_from_stacked_round_trips_through_transformers(hf_pair, tmp_path):
  """Scanned model (layer 1's k_proj and vision block 1's qkv perturbed) -> save_pretrained -> transformers from_pretrained
  -> its logits equal ours; the written tensors are the per-layer names transformers expects."""
  import torch
  from transformers import AutoModelForImageTextToText
  from tars_jax.agent.tokenizer import IMAGE
  from tars_jax.models.interop import hf_io
  _, path, _, _ = hf_pair
  scn = hf_io.load_pretrained(path, image_h=56, image_w=56, scan_layers=True)
  k = scn.policy.trunk.decoder.layers.self_attn.k_proj.kernel
  k[...] = k[...].at[1].multiply(1.5)  # only layer 1: a layer mix-up on export would show
  qkv = scn.policy.trunk.visual.blocks.attn.qkv.kernel
  qkv[...] = qkv[...].at[1].multiply(1.5)  # likewise vision block 1
  hf_io.save_pretrained(scn, str(tmp_path))
  hf2 = AutoModelForImageTextToText.from_pretrained(str(tmp_path)).eval()
  orig = AutoModelForImageTextToText.from_pretrained(path).eval()
  sd2, sd0 = hf2.state_dict(), orig.state_dict()
  name = "model.language_model.layers.{}.self_attn.k_proj.weight"
  np.testing.assert_allclose(sd2[name.format(1)].numpy(), 1.5 * sd0[name.format(1)].numpy(), rtol=1e-6)
  np.testing.assert_array_equal(sd2[name.format(0)].numpy(), sd0[name.format(0)].numpy())
  vname = "model.visual.blocks.{}.attn.qkv.weight"
  np.testing.assert_allclose(sd2[vname.format(1)].numpy(), 1.5 * sd0[vname.format(1)].numpy(), rtol=1e-6)
  np.testing.assert_array_equal(sd2[vname.format(0)].numpy(), sd0[vname.format(0)].numpy())
  ids, mask, images = _prompts(np.random.default_rng(5))
  pix, grid = _hf_pixels(images)
  with torch.no_grad():
    want = hf2(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pix),
               image_grid_thw=torch.tensor(grid),
               mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64))).logits.numpy()
  got = np.asarray(scn(ids, mask, pix, grid))
  m = mask.astype(bool)
  assert np.abs(got[m] - want[m]).max() <= f32_atol(np.abs(want[m]).max(), forward_terms(scn.policy.cfg, ids.shape[1]))
  back = hf_io.load_pretrained(str(tmp_path), image_h=56, image_w=56, scan_layers=True)
  np.testing.assert_array_equal(np.asarray(back(ids, mask, pix, grid)), got)


@pytest.mark.parametrize("name", ["model.language_model.layers.2.self_attn.q_proj.weight",
                                  "model.visual.blocks.1.attn.qkv.weight"])
def test_bad_tensor_shape_names_tensor_and_shapes_when_scanned(hf_pair, tmp_path, name):
  """A decoder layer's or a vision block's tensor with half its input width: the error names it and
  both shapes (checked per tensor before the per-layer arrays are stacked)."""
  import re
  from safetensors.numpy import load_file, save_file
  from tars_jax.models.interop import hf_io
  _, path, _, _ = hf_pair
  for f in os.listdir(path):
    if f.endswith(".json"):
      with open(os.path.join(path, f)) as src, open(os.path.join(tmp_path, f), "w") as dst:
        dst.write(src.read())
  t = load_file(os.path.join(path, "model.safetensors"))
  full = t[name].shape
  t[name] = t[name][:, :full[1] // 2]
  save_file(t, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
  want = rf"{re.escape(name[len('model.'):])}.*{re.escape(str(t[name].shape))}.*{re.escape(str(full))}"
  with pytest.raises(hf_io.CheckpointMismatch, match=want):
    hf_io.load_pretrained(str(tmp_path), image_h=56, image_w=56, scan_layers=True)


# --- 8 simulated devices (subprocess) ------------------------------------------------------------------

@pytest.mark.long
def test_scanned_loss_and_grads_on_mesh_equal_single_device(tmp_path):
  out = tmp_path / "scan_mesh.json"
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, os.path.abspath(__file__), str(out)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
  r = json.loads(out.read_text())
  assert r["n_devices"] == 8
  assert r["loss_diff"] <= TOL and r["grad_max_diff"] <= TOL, r
  assert r["grad_max_abs"] > 1e-3
  # stacked expert weights [layers, E, D, 2, I]: layer axis replicated, experts over "expert", D over
  # fsdp (size 1 here), gate|up replicated, I over "tensor" -> device 0 holds [3, 2, 32, 2, 8]
  assert r["w_gate_up"] == {"spec": [None, "expert", "fsdp", None, "tensor"], "shard": [3, 2, 32, 2, 8]}, r["w_gate_up"]


def _worker(out_path):
  """Scanned MoE policy (ragged, expert-parallel) on mesh (2, 1, 2, 2) vs one device: loss and grads."""
  assert jax.device_count() == 8, jax.devices()
  cfg = _cfg("qwen3_vl_moe", scan_layers=True, moe_impl="ragged", hidden=32, head_dim=8, moe_intermediate=16,
             image_h=28, image_w=28, vision_hidden=16, vision_mlp=32)
  gd, params = nnx.split(_policy(cfg))
  batch = _batch(cfg, b=8, t=12)

  def loss(p, *b):
    return _loss(nnx.merge(gd, p), *b)[0]

  vg = jax.value_and_grad(loss)
  ref_l, ref_g = jax.jit(vg)(params, *batch)
  mesh = sharding.make_mesh((2, 1, 2, 2))
  rules = sharding.make_rules()
  sparams = sharding.shard(params, mesh, rules)
  with sharding.activate(mesh, rules):
    l, g = jax.jit(vg)(sparams, *batch)
  diffs = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), ref_g, g)
  w = sparams["trunk"]["decoder"]["layers"]["mlp"]["w_gate_up"].get_value()
  spec = [list(a) if isinstance(a, tuple) else a for a in w.sharding.spec]
  res = dict(n_devices=jax.device_count(), loss_diff=abs(float(ref_l) - float(l)),
             grad_max_diff=max(jax.tree.leaves(diffs)),
             grad_max_abs=max(float(jnp.abs(x).max()) for x in jax.tree.leaves(ref_g)),
             w_gate_up=dict(spec=spec + [None] * (5 - len(spec)), shard=list(w.addressable_shards[0].data.shape)))
  with open(out_path, "w") as f:
    json.dump(res, f)


if __name__ == "__main__":
  _worker(sys.argv[1])
