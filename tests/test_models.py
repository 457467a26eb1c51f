"""Model family: M-RoPE positions by hand and against transformers' `get_rope_index`, router and
load-balance loss by hand / numpy, MoE against a naive per-token loop, image splicing order,
padding invariance, gradients into the vision tower, critic, config."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from tars_jax.agent.tokenizer import BOS, IMAGE, PAD, VISION_END, VISION_START
from tars_jax.models import ModelConfig, Policy, ValueModel, rope_positions
from tars_jax.models.moe import DenseMLP, MoE, load_balance_loss, route
from tars_jax.models.rope import mrope_cos_sin, next_position
from _shared import TINY_CFG, assert_close_f32, forward_terms, fwd, vision_terms

CFG = TINY_CFG


# --- M-RoPE positions --------------------------------------------------------------------------------

def test_rope_positions_by_hand():
  # text(2) + image 2x3 + text(2); then the same row left-padded by 2 (its last 2 tokens cut)
  toks = jnp.array([[BOS, 65] + [IMAGE] * 6 + [66, 67], [PAD, PAD, BOS, 65] + [IMAGE] * 6])
  mask = toks != PAD
  pos = np.asarray(rope_positions(toks, mask, IMAGE, (2, 3)))
  assert pos.shape == (3, 2, 10) and pos.dtype == np.int32
  np.testing.assert_array_equal(pos[0, 0], [0, 1, 2, 2, 2, 2, 2, 2, 5, 6])  # t = start
  np.testing.assert_array_equal(pos[1, 0], [0, 1, 2, 2, 2, 3, 3, 3, 5, 6])  # h = start + row
  np.testing.assert_array_equal(pos[2, 0], [0, 1, 2, 3, 4, 2, 3, 4, 5, 6])  # w = start + col
  np.testing.assert_array_equal(pos[:, 1, 2:], pos[:, 0, :8])  # starts at 0 at the first real token
  np.testing.assert_array_equal(pos[:, 1, :2], 0)
  # next text token after each row: 7 (after "66 67") and 5 (right after the image: 2 + max(2, 3))
  np.testing.assert_array_equal(next_position(toks, mask, IMAGE, (2, 3)), [7, 5])


def test_rope_positions_match_transformers_get_rope_index():
  import torch  # installed by scripts/setup.sh: a missing torch fails, never skips
  from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
  from types import SimpleNamespace
  gh, gw = 3, 2
  img = [VISION_START] + [IMAGE] * (gh * gw) + [VISION_END]
  rows = [[BOS, 1, 2] + img + [3] + img + [4, 5], [BOS] + img + [7], [BOS, 9] + img]
  t = max(len(r) for r in rows)
  toks = np.full((3, t), PAD, np.int64)
  mask = np.zeros((3, t), np.int64)
  for i, r in enumerate(rows):
    toks[i, t - len(r):], mask[i, t - len(r):] = r, 1  # left padding
  fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)))
  fake.get_vision_position_ids = lambda *a, **k: Qwen2VLModel.get_vision_position_ids(fake, *a, **k)
  ids = torch.tensor(toks)
  grids = torch.tensor([[1, 2 * gh, 2 * gw]] * 4)  # in patches (before the 2x2 merge)
  want, _ = Qwen2VLModel.get_rope_index(fake, ids, (ids == IMAGE).int(), grids, None, torch.tensor(mask))
  got = rope_positions(jnp.asarray(toks, jnp.int32), jnp.asarray(mask, bool), IMAGE, (gh, gw))
  np.testing.assert_array_equal(np.asarray(got), want.numpy())


# --- MoE ---------------------------------------------------------------------------------------------

def test_router_and_aux_loss_by_hand():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
  probs, w, idx = route(logits, 2, True)
  np.testing.assert_allclose(w, [[0.5 / 0.8, 0.3 / 0.8], [0.8 / 0.9, 0.1 / 0.9]], rtol=1e-5)
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  _, w_raw, _ = route(logits, 2, False)
  np.testing.assert_allclose(w_raw, [[0.5, 0.3], [0.8, 0.1]], rtol=1e-5)
  # token0 -> {0, 1}; token1 -> {2, 0} (0.1 tie between experts 0 and 1: lower index)
  # f_e = assignments / tokens = [2, 1, 1] / 2; P_e = mean prob = [0.3, 0.2, 0.5]
  want = 3 * (1.0 * 0.3 + 0.5 * 0.2 + 0.5 * 0.5)
  assert float(load_balance_loss(probs, idx, 3)) == pytest.approx(want, rel=1e-5)
  # masking token1 out: f = [1, 1, 0], P = [0.5, 0.3, 0.2]
  assert float(load_balance_loss(probs, idx, 3, jnp.array([1, 0]))) == pytest.approx(3 * 0.8, rel=1e-5)


def _np_switch_loss(layer_logits, top_k, e, mask):
  """transformers `load_balancing_loss_func` in numpy: counts and probs pooled over all layers."""
  counts, psum, rows = np.zeros(e), np.zeros(e), 0.0
  for lg in layer_logits:
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    sel = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    for n in range(p.shape[0]):
      counts[sel[n]] += mask[n]
    psum += (p * mask[:, None]).sum(0)
    rows += mask.sum()
  return e * np.sum(counts / rows * psum / rows)


def test_trunk_aux_loss_pools_layers_like_transformers():
  pol = Policy(CFG, nnx.Rngs(5))
  toks = jnp.array([[PAD, BOS, 1, 2, 3], [BOS, 4, 5, 6, 7]])
  mask = toks != PAD
  pos = rope_positions(toks, mask, IMAGE, CFG.merged_grid)
  aux = fwd(pol, toks, pos, mask).aux_loss

  @nnx.jit
  def router_logits(pol):  # each MoE layer's router logits on its own input, re-running layers by hand
    x = pol.trunk.embed_tokens(toks)
    cos, sin = mrope_cos_sin(pos, CFG.head_dim, CFG.rope_theta, CFG.sections)
    out = []
    for layer in pol.trunk.decoder.layers:
      h = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask)[0]
      out.append(layer.mlp.router(layer.post_attention_layernorm(h)).reshape(-1, CFG.experts))
      x = layer(x, cos, sin, mask)[0]
    return out
  layer_logits = [np.asarray(lg) for lg in router_logits(pol)]
  want = _np_switch_loss(layer_logits, CFG.top_k, CFG.experts, np.asarray(mask).reshape(-1).astype(float))
  assert float(aux) == pytest.approx(want, rel=1e-5)
  per_layer_mean = np.mean([_np_switch_loss([lg], 2, 4, np.asarray(mask).reshape(-1).astype(float))
                            for lg in layer_logits])
  assert abs(want - per_layer_mean) > 1e-7  # pooling differs from averaging per layer: the test can tell


def test_moe_equals_naive_loop():
  moe = MoE(CFG, nnx.Rngs(1))
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, CFG.hidden))
  y, (probs, idx) = moe(x)
  flat = np.asarray(x).reshape(-1, CFG.hidden)
  lg = np.asarray(moe.router(jnp.asarray(flat)))
  wgu, wd = (np.asarray(p[...]) for p in (moe.w_gate_up, moe.w_down))
  wg, wu = wgu[:, :, 0], wgu[:, :, 1]
  want = np.zeros_like(flat)
  for n in range(flat.shape[0]):
    p = np.exp(lg[n] - lg[n].max())
    p /= p.sum()
    sel = np.argsort(-p)[:CFG.top_k]
    ws = p[sel] / p[sel].sum()
    for e, wt in zip(sel, ws):
      g = flat[n] @ wg[e]
      want[n] += wt * ((g / (1 + np.exp(-g))) * (flat[n] @ wu[e])) @ wd[e]
  assert_close_f32(np.asarray(y).reshape(-1, CFG.hidden), want, terms=2 * CFG.hidden + CFG.moe_intermediate)
  assert float(np.abs(want).mean()) > 1e-3


def test_decoder_sparse_step_mixes_dense_layers():
  cfg = ModelConfig(**{**CFG.to_dict(), "decoder_sparse_step": 2})
  pol = Policy(cfg, nnx.Rngs(0))
  kinds = [type(l.mlp) for l in pol.trunk.decoder.layers]
  assert kinds == [DenseMLP, MoE]


# --- Policy / critic ---------------------------------------------------------------------------------

def _batch(rng, lens, n_images=1):
  n = CFG.n_img_tokens
  rows = []
  for l in lens:
    r = [BOS] + list(rng.integers(0, 255, l))
    for _ in range(n_images):
      r += [VISION_START] + [IMAGE] * n + [VISION_END] + [10]
    rows.append(r)
  p = max(len(r) for r in rows)
  toks = np.full((len(rows), p), PAD, np.int32)
  mask = np.zeros_like(toks, bool)
  for i, r in enumerate(rows):
    toks[i, p - len(r):], mask[i, p - len(r):] = r, True
  pix = rng.random((len(rows), n_images, CFG.image_h, CFG.image_w, 3)).astype(np.float32)
  return jnp.asarray(toks), jnp.asarray(mask), jnp.asarray(pix)


def test_image_features_fill_image_blocks_in_order():
  pol = Policy(CFG, nnx.Rngs(0))
  toks, mask, pix = _batch(np.random.default_rng(0), [2, 4], n_images=2)
  img_mask = jnp.array([[True, True], [True, False]])
  x = nnx.jit(lambda t: t.embed_inputs(toks, pix, img_mask)[0])(pol.trunk)
  alone = nnx.jit(lambda v: v(pix.reshape((-1,) + pix.shape[2:])))(pol.trunk.visual).reshape(2, 2, -1, CFG.hidden)
  n = CFG.n_img_tokens
  for b in range(2):
    where = np.nonzero(np.asarray(toks[b]) == IMAGE)[0]
    for m in range(2):
      want = alone[b, m] * float(img_mask[b, m])
      assert_close_f32(x[b, where[m * n:(m + 1) * n]], want, terms=vision_terms(CFG))
    text = np.asarray(toks[b]) != IMAGE
    np.testing.assert_array_equal(x[b, text], pol.trunk.embed_tokens(toks[b, text]))
  assert float(jnp.abs(x[1, where[n:]]).max()) == 0.0  # slot 1 of row 1 is not real


def test_padding_invariance_and_vision_gradient():
  pol = Policy(CFG, nnx.Rngs(0))
  toks, mask, pix = _batch(np.random.default_rng(0), [3, 9])
  pos = rope_positions(toks, mask, IMAGE, CFG.merged_grid)
  logits, aux, _, _ = fwd(pol, toks, pos, mask, pix)
  assert logits.dtype == jnp.float32 and logits.shape == toks.shape + (CFG.vocab_size,)
  r = toks[0][mask[0]][None]  # row 0 without its left padding
  m1 = jnp.ones_like(r, bool)
  alone = fwd(pol, r, rope_positions(r, m1, IMAGE, CFG.merged_grid), m1, pix[:1]).logits
  assert_close_f32(logits[0][mask[0]], alone[0], terms=forward_terms(CFG, toks.shape[1]))
  # changing a padding token's id changes nothing
  toks2 = toks.at[0, 0].set(77)
  logits2 = fwd(pol, toks2, pos, mask, pix).logits
  np.testing.assert_allclose(logits2[0][mask[0]], logits[0][mask[0]], atol=1e-6)

  def lm_loss(model):
    lg, aux, _, _ = model(toks, pos, mask, pix)
    lp = jax.nn.log_softmax(lg[:, :-1])
    nll = -jnp.take_along_axis(lp, toks[:, 1:, None], -1)[..., 0]
    m = mask[:, 1:] & mask[:, :-1]
    return jnp.sum(nll * m) / m.sum() + 0.01 * aux
  loss, grads = nnx.jit(nnx.value_and_grad(lm_loss))(pol)
  assert np.isfinite(float(loss))
  vis = grads.trunk.visual
  for g in (vis.patch_embed.proj.kernel, vis.pos_embed, vis.blocks[0].attn.qkv.kernel, vis.merger.linear_fc2.kernel):
    g = np.asarray(g[...])
    assert np.all(np.isfinite(g)) and np.abs(g).sum() > 0
  # the router gets gradient through the aux loss and the routing weights
  assert float(jnp.abs(grads.trunk.decoder.layers[0].mlp.router.kernel[...]).sum()) > 0


def test_value_model_separate_params_zero_init_head():
  toks, mask, pix = _batch(np.random.default_rng(3), [2, 5])
  pos = rope_positions(toks, mask, IMAGE, CFG.merged_grid)
  val = ValueModel(CFG, nnx.Rngs(2))
  v, aux = fwd(val, toks, pos, mask, pix)
  assert v.shape == toks.shape and v.dtype == jnp.float32
  np.testing.assert_array_equal(v, 0.0)  # zero-initialised head
  val.value_head.bias[...] = jnp.array([0.5])
  val.value_head.kernel[...] = jnp.ones_like(val.value_head.kernel[...])
  h, _ = nnx.jit(lambda m: m.features(toks, pos, mask, pix))(val)
  assert_close_f32(fwd(val, toks, pos, mask, pix)[0], h.sum(-1) + 0.5, terms=forward_terms(CFG, toks.shape[1]) + CFG.hidden,
                   scale=float(jnp.sqrt(jnp.sum(h ** 2, -1)).max()) + 0.5)  # h's mixed-sign sum: its root sum of squares
  pol = Policy(CFG, nnx.Rngs(2))
  hp, _ = nnx.jit(lambda m: m.features(toks, pos, mask, pix))(pol)
  assert hp.shape == h.shape
  assert not np.allclose(pol.trunk.embed_tokens.embedding[...], 0)


# Qwen2.5-VL's image normalisation (transformers `Qwen2VLImageProcessor`: OPENAI_CLIP_MEAN / _STD).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def test_config_from_dict_keeps_fractional_image_normalisation():
  """`image_mean` / `image_std` from a ConfigDict (lists, as a config file writes them) stay the CLIP
  floats, and `patchify` normalises a pixel to (x - mean) / std worked in float64 numpy."""
  c = ml_collections.ConfigDict({"family": "qwen2_5_vl", "experts": 0, "deepstack_visual_indexes": [],
                                 "hidden": 128, "heads": 4, "head_dim": 32,
                                 "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD)})
  cfg = ModelConfig.from_dict(c)
  assert cfg.pixel_norm == (CLIP_MEAN, CLIP_STD)
  from tars_jax.models.vision import patchify
  p, t, m = cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size
  img = np.full((1, p * m, p * m, 3), 0.25, np.float32)
  got = np.asarray(patchify(jnp.asarray(img), p, t, m, *cfg.pixel_norm))
  want = (0.25 - np.asarray(CLIP_MEAN, np.float64)) / np.asarray(CLIP_STD, np.float64)  # per channel
  # each patch flattened (channel, time, dy, dx): channel c fills t * p * p consecutive entries
  np.testing.assert_allclose(got, np.broadcast_to(np.repeat(want, t * p * p), got.shape), rtol=1e-6)


def test_config_from_dict_and_presets():
  c = ml_collections.ConfigDict({"hidden": 64, "mrope_section": [4, 2, 2], "head_dim": 16})
  cfg = ModelConfig.from_dict(c)
  assert cfg.hidden == 64 and cfg.sections == (4, 2, 2)
  with pytest.raises(ValueError, match="nonsense"):
    ModelConfig.from_dict({"nonsense": 1})
  with pytest.raises(ValueError):
    ModelConfig(mrope_section=(1, 1, 1))
  tiny = ModelConfig.tiny()
  assert tiny.merged_grid == (8, 6) and tiny.n_img_tokens == 48 and tiny.sections == (6, 5, 5)
  assert tiny.pos_table_side == 16 and tiny.family == "qwen3_vl_moe"
  with pytest.raises(ValueError, match="qwen3_vl_moe"):
    ModelConfig(family="llama")
  with pytest.raises(ValueError):
    ModelConfig(image_h=100).merged_grid
  with pytest.raises(ValueError, match=r"deepstack_visual_indexes \(1, 1\) repeats a block"):
    ModelConfig(deepstack_visual_indexes=(1, 1))


@pytest.mark.parametrize("remat", [pytest.param("full", marks=pytest.mark.slow), "dots"])
def test_remat_same_loss_and_gradients(remat):
  """Rematerialisation changes memory, not math: loss and every gradient equal the plain ones."""
  import dataclasses
  toks, mask, pix = _batch(np.random.default_rng(5), [2, 6])
  pos = rope_positions(toks, mask, IMAGE, CFG.merged_grid)

  def loss_and_grads(cfg):
    pol = Policy(cfg, nnx.Rngs(0))
    def loss(m):
      lg, aux, _, _ = m(toks, pos, mask, pix)
      return jnp.mean(jax.nn.log_softmax(lg)[..., 7]) + 0.1 * aux
    return nnx.jit(nnx.value_and_grad(loss))(pol)

  l0, g0 = loss_and_grads(CFG)
  l1, g1 = loss_and_grads(dataclasses.replace(CFG, remat=remat))
  assert_close_f32(l1, l0, terms=forward_terms(CFG, toks.shape[1]))
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):  # float32 reassociation
    assert_close_f32(np.asarray(b), np.asarray(a), terms=2 * forward_terms(CFG, toks.shape[1]) + toks.size)
  with pytest.raises(ValueError, match="remat"):
    ModelConfig(remat="some")


def test_rotary_cos_sin_computed_once_on_cpu(monkeypatch):
  """`rope.computed_once`: XLA:CPU fuses the rotary cos / sin into every fusion that reads them and so
  recomputes them per layer and head (in the train step also per backward product); behind the
  conditional the compiled forward holds one cosine and one sine per branch (2 each), with the same
  logits as plain cos / sin."""
  import re
  from tars_jax.models import rope
  toks, mask, pix = _batch(np.random.default_rng(6), [4, 7])
  pos = rope_positions(toks, mask, IMAGE, CFG.merged_grid)
  graphdef, params = nnx.split(Policy(CFG, nnx.Rngs(0)))

  def compiled_forward():
    fwd = jax.jit(lambda p: nnx.merge(graphdef, p)(toks, pos, mask, pix)[0]).lower(params).compile()
    text = fwd.as_text()
    return fwd(params), len(re.findall(r" cosine\(", text)), len(re.findall(r" sine\(", text))

  once, n_cos, n_sin = compiled_forward()
  assert (n_cos, n_sin) == (2, 2)
  monkeypatch.setattr(rope, "computed_once", lambda fn, x: fn(x))
  plain, n_cos_plain, n_sin_plain = compiled_forward()
  assert n_cos_plain > 2 and n_sin_plain > 2  # what the conditional prevents
  assert_close_f32(once, plain, terms=forward_terms(CFG, toks.shape[1]))
