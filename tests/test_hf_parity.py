"""Parity with transformers (the reference implementation), for both families: a tiny random-init
`Qwen3VLMoeForConditionalGeneration` (MoE and dense layers, DeepStack on both vision blocks, a
position table resampled to every image size, temporal patches of 2) and `Qwen2_5_VLForConditionalGeneration`
(window attention with 2x2-token windows in blocks 0 and 2, full attention in block 1; dense Qwen2
decoder with biases), built offline in float32, are saved by transformers, loaded by
`hf_io.load_pretrained`, and both sides run on the same arrays made by transformers' own image
processor: logits within 1e-4, the same load-balance loss, and greedy decoding with our KV-cache
sampler equal to transformers `generate`."""

import numpy as np
import pytest

import torch  # installed by scripts/setup.sh: a missing torch fails, never skips

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tars_jax.agent.tokenizer import BOS, IMAGE, PAD, VISION_END, VISION_START  # noqa: E402
from tars_jax.models import moe, rope_positions  # noqa: E402
from tars_jax.models.inference import sampler
from tars_jax.models.interop import hf_io
from _shared import f32_atol, forward_terms  # noqa: E402


FAMILIES = ["qwen3_vl_moe", "qwen2_5_vl"]


def _hf_config(family, merge: int = 2):
  from transformers import Qwen2_5_VLConfig, Qwen3VLMoeConfig
  if family == "qwen2_5_vl":
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.2,
                         bos_token_id=None, eos_token_id=None,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, window_size=56,
                           fullatt_block_indexes=[1], hidden_act="silu", initializer_range=0.2),
        image_token_id=IMAGE, video_token_id=263, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False)
  return Qwen3VLMoeConfig(
      text_config=dict(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=24,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                       rms_norm_eps=1e-6, initializer_range=0.2,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                            mrope_interleaved=True)),
      vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                         temporal_patch_size=2, spatial_merge_size=merge, out_hidden_size=64,
                         num_position_embeddings=25, deepstack_visual_indexes=[0, 1], initializer_range=0.2),
      image_token_id=IMAGE, video_token_id=263, vision_start_token_id=VISION_START,
      vision_end_token_id=VISION_END, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
  """(transformers model, our HFModel loaded from its saved directory, directory)."""
  from transformers import AutoModelForImageTextToText
  torch.manual_seed(0)
  hf = AutoModelForImageTextToText.from_config(_hf_config(request.param)).eval()
  with torch.no_grad():  # visible norms / biases (their init is 1 / 0, which hides layout mistakes)
    for name, p in hf.named_parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  path = str(tmp_path_factory.mktemp("hf_ckpt"))
  hf.save_pretrained(path)
  ours = hf_io.load_pretrained(path, image_h=56, image_w=84)
  return hf, ours, path


def _processor(family, merge: int = 2):
  """transformers' Qwen2-VL image processor (no resizing) with the family's normalisation."""
  from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
  from tars_jax.models.config import CLIP_MEAN, CLIP_STD
  mean, std = (CLIP_MEAN, CLIP_STD) if family == "qwen2_5_vl" else ((0.5,) * 3, (0.5,) * 3)
  return Qwen2VLImageProcessorPil(do_resize=False, patch_size=14, temporal_patch_size=2, merge_size=merge,
                                  image_mean=list(mean), image_std=list(std))


def _inputs(pair, rng, rows_images, text_len=(3, 7)):
  """Left-padded batch: each row = BOS text (<vs> IMAGE*n <ve> text)* for its images (H, W).

  Returns numpy (input_ids, attention_mask, pixel_values | None, image_grid_thw | None, images uint8)."""
  rows, images = [], []
  for sizes in rows_images:
    r = [BOS] + list(rng.integers(0, 256, rng.integers(*text_len)))
    for h, w in sizes:
      images.append(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
      side = 14 * pair[1].cfg.spatial_merge_size  # pixels per decoder token
      r += [VISION_START] + [IMAGE] * ((h // side) * (w // side)) + [VISION_END] + list(rng.integers(0, 256, 2))
    rows.append(r)
  t = max(len(r) for r in rows)
  ids = np.full((len(rows), t), PAD, np.int64)
  mask = np.zeros((len(rows), t), np.int64)
  for i, r in enumerate(rows):
    ids[i, t - len(r):], mask[i, t - len(r):] = r, 1
  if not images:
    return ids, mask, None, None, images
  out = _processor(pair[1].cfg.family, pair[1].cfg.spatial_merge_size)(images=images, return_tensors="np")
  return ids, mask, out["pixel_values"], out["image_grid_thw"], images


def _hf_forward(hf, ids, mask, pix, grid):
  kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
  if hf.config.model_type == "qwen3_vl_moe":
    kw["output_router_logits"] = True
  if pix is not None:
    kw.update(pixel_values=torch.tensor(pix), image_grid_thw=torch.tensor(grid),
              mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)))
  with torch.no_grad():
    out = hf(**kw)
  aux = getattr(out, "aux_loss", None)
  return out.logits.numpy(), 0.0 if aux is None else float(aux)  # dense Qwen2.5-VL: no aux loss


def _check(pair, ids, mask, pix, grid):
  hf, ours, _ = pair
  want, want_aux = _hf_forward(hf, ids, mask, pix, grid)
  got, aux = ours.forward(ids, mask, pix, grid)
  m = mask.astype(bool)
  err = float(np.abs(np.asarray(got)[m] - want[m]).max())
  tol = f32_atol(np.abs(want[m]).max(), forward_terms(ours.policy.cfg, ids.shape[1]))  # float32 rule, `_shared`
  assert err <= tol, f"max abs logit error {err} > {tol}"
  assert np.abs(want[m]).max() > 0.5  # logits far from 0: the comparison is not vacuous
  assert abs(float(aux) - want_aux) <= f32_atol(abs(want_aux), ours.policy.cfg.hidden + ids.size)  # router, tokens


def test_text_only(pair):
  ids, mask, *_ = _inputs(pair, np.random.default_rng(0), [[], []], text_len=(20, 21))
  _check(pair, ids, mask, None, None)


def test_one_image(pair):
  ids, mask, pix, grid, _ = _inputs(pair, np.random.default_rng(1), [[(56, 84)]])
  _check(pair, ids, mask, pix, grid)


def test_several_images_of_different_sizes(pair):
  ids, mask, pix, grid, _ = _inputs(pair, np.random.default_rng(2), [[(56, 84), (28, 56)], [(84, 56)]])
  assert len({tuple(g) for g in grid}) == 3
  _check(pair, ids, mask, pix, grid)


def test_padded_batch_and_policy_api(pair):
  """Left padding of different lengths; and the main job's `Policy` call (images [B, M, H, W, 3] in
  [0, 1], `rope_positions`) on the same batch gives transformers' logits too."""
  rng = np.random.default_rng(3)
  ids, mask, pix, grid, images = _inputs(pair, rng, [[(56, 84)], [(56, 84)], [(56, 84)]], text_len=(2, 12))
  assert len(set(mask.sum(1))) > 1
  _check(pair, ids, mask, pix, grid)
  hf, ours, _ = pair
  want, _ = _hf_forward(hf, ids, mask, pix, grid)
  pol = ours.policy
  toks, m = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)
  pos = rope_positions(toks, m, IMAGE, pol.cfg.merged_grid)
  imgs = jnp.asarray(np.stack(images)[:, None] / 255.0, jnp.float32)
  got = jax.jit(lambda *a: pol(*a).logits)(toks, pos, m, imgs)
  err = float(np.abs(np.asarray(got)[mask.astype(bool)] - want[mask.astype(bool)]).max())
  assert err <= f32_atol(np.abs(want[mask.astype(bool)]).max(), forward_terms(pol.cfg, ids.shape[1])), err


def test_unmerged_patches(tmp_path):
  """`spatial_merge_size=1` (one decoder token per 14-px patch, no 2x2 merge; the config knob the
  click-test-2 sweep tried, benchmarks/RESULTS.md): Qwen3-VL-MoE with merge size 1 in transformers and
  ours give the same logits, through `HFModel.forward` and through the `Policy` call with
  `rope_positions` on the unmerged grid."""
  from transformers import AutoModelForImageTextToText
  torch.manual_seed(1)
  hf = AutoModelForImageTextToText.from_config(_hf_config("qwen3_vl_moe", merge=1)).eval()
  hf.save_pretrained(str(tmp_path))
  ours = hf_io.load_pretrained(str(tmp_path), image_h=56, image_w=84)
  assert ours.cfg.spatial_merge_size == 1 and tuple(ours.cfg.merged_grid) == (4, 6)
  pair = (hf, ours, str(tmp_path))
  ids, mask, pix, grid, images = _inputs(pair, np.random.default_rng(7), [[(56, 84)], [(56, 84)]], text_len=(2, 9))
  assert (ids == IMAGE).sum() == 2 * 24  # 4 x 6 patches per image, none merged
  _check(pair, ids, mask, pix, grid)
  want, _ = _hf_forward(hf, ids, mask, pix, grid)
  pol = ours.policy
  toks, m = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)
  pos = rope_positions(toks, m, IMAGE, pol.cfg.merged_grid)
  got = jax.jit(lambda *a: pol(*a).logits)(toks, pos, m, jnp.asarray(np.stack(images)[:, None] / 255.0, jnp.float32))
  err = float(np.abs(np.asarray(got)[mask.astype(bool)] - want[mask.astype(bool)]).max())
  assert err <= f32_atol(np.abs(want[mask.astype(bool)]).max(), forward_terms(pol.cfg, ids.shape[1])), err


@pytest.mark.parametrize("attention_impl", ["einsum", "recompute"])
def test_gradients_match_torch_autograd(pair, attention_impl):
  """The train step's gradients: the mean next-token cross-entropy over real tokens of a left-padded
  batch with images, differentiated by JAX (our `Policy`, both attention cores: autodiff through the
  einsum softmax, and the custom VJP that recomputes the probabilities) and by torch autograd
  (transformers' model, same weights): every parameter's gradient, vision encoder included, within
  1e-4 of the largest gradient entry of its tensor."""
  import dataclasses
  from flax import nnx
  from tars_jax.models.interop.hf_model import HFModel
  hf, ours, _ = pair
  rng = np.random.default_rng(6)
  ids, mask, pix, grid, images = _inputs(pair, rng, [[(56, 84)], [(56, 84)], [(56, 84)]], text_len=(2, 12))
  assert len(set(mask.sum(1))) > 1
  keep = (mask[:, 1:] * mask[:, :-1]).astype(np.float32)  # next-token targets inside the real tokens

  hf.zero_grad(set_to_none=True)
  logits = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pix),
              image_grid_thw=torch.tensor(grid),
              mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64))).logits
  logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, torch.tensor(ids[:, 1:, None])).squeeze(-1)
  want_loss = -(logp * torch.tensor(keep)).sum() / keep.sum()
  want_loss.backward()
  want = {n: p.grad.numpy() for n, p in hf.named_parameters() if p.grad is not None}

  cfg = dataclasses.replace(ours.cfg, attention_impl=attention_impl)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: HFModel(cfg, nnx.Rngs(0))))
  model = nnx.merge(graphdef, nnx.state(ours))
  gd, params = nnx.split(model.policy)
  toks, m = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)
  pos = rope_positions(toks, m, IMAGE, cfg.merged_grid)
  imgs = jnp.asarray(np.stack(images)[:, None] / 255.0, jnp.float32)

  def loss(params):
    logits = nnx.merge(gd, params)(toks, pos, m, imgs).logits
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], -1), toks[:, 1:, None], -1)[..., 0]
    return -jnp.sum(lp * keep) / keep.sum()

  got_loss, grads = jax.jit(jax.value_and_grad(loss))(params)
  assert abs(float(got_loss) - float(want_loss.detach())) <= f32_atol(abs(float(want_loss.detach())),
                                                                       forward_terms(cfg, ids.shape[1]))  # mean -log p > 0
  flat = {("policy",) + tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
  checked = 0
  for spec in hf_io.tensor_map(nnx.state(model, nnx.Param), cfg.temporal_patch_size, cfg.family):
    if spec.hf_name not in want:
      continue  # no gradient in torch either (e.g. an unused position table row set)
    g, w = spec.to_hf(flat[spec.path]), want[spec.hf_name]
    scale = float(np.abs(w).max())
    assert np.abs(g - w).max() <= 1e-4 * max(scale, 1e-3), (spec.hf_name, float(np.abs(g - w).max()), scale)
    checked += 1
  assert checked >= 0.9 * len(want), (checked, len(want))


def hf_greedy(hf, ids, mask, pix, grid, n: int) -> np.ndarray:
  """transformers `generate`: n greedy tokens [B, n] after the prompts; asserts every step's top-2
  logit gap > 1e-3, so that an equal sequence from our sampler is not luck."""
  with torch.no_grad():
    out = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pix),
                      image_grid_thw=torch.tensor(grid), mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=PAD,
                      output_scores=True, return_dict_in_generate=True)
  top2 = np.sort(torch.stack(out.scores, 1).numpy(), -1)[..., -2:]  # [B, n, 2]
  assert (top2[..., 1] - top2[..., 0]).min() > 1e-3
  return out.sequences[:, ids.shape[1]:].numpy()


@pytest.mark.slow
@pytest.mark.parametrize("moe_impl", ["dense", "grouped"])
def test_greedy_decoding_matches_generate(pair, moe_impl):
  """32 greedy tokens from our KV-cache sampler (left-padded batch, one image per row) equal
  transformers `generate`; every step's top-2 logit gap is checked to be far above 1e-4, so an
  equal sequence is not luck and a different one would be a real mismatch. "grouped": the decode
  loop's experts run on the FFI kernel (`expert_kernel.py`; its use asserted in
  `test_decode_experts.py`)."""
  hf, ours, path = pair
  if moe_impl != "dense":
    ours = hf_io.load_pretrained(path, image_h=56, image_w=84, moe_impl=moe_impl)
    cfg = ours.cfg  # qwen2_5_vl has no MoE layers: there it decodes as with "dense"
    assert not cfg.experts or moe.decode_kernel_applies(cfg)
  rng = np.random.default_rng(4)
  ids, mask, pix, grid, images = _inputs(pair, rng, [[(56, 84)], [(56, 84)]], text_len=(2, 9))
  n = 32
  want = hf_greedy(hf, ids, mask, pix, grid, n)
  imgs = jnp.asarray(np.stack(images)[:, None] / 255.0, jnp.float32)
  gen = sampler.generate(ours.policy, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool), imgs, None,
                         jax.random.PRNGKey(0), max_new_tokens=n, temperature=0.0, eos_id=-1, pad_id=PAD)
  np.testing.assert_array_equal(np.asarray(gen.tokens), want)


@pytest.mark.slow
def test_save_pretrained_round_trip(pair, tmp_path):
  """Our weights -> save_pretrained -> transformers from_pretrained -> the same logits; and load back."""
  from transformers import AutoModelForImageTextToText
  _, ours, _ = pair
  # perturb our copy so the round trip cannot pass by re-reading the original file
  pol = ours.policy
  k = pol.trunk.decoder.layers[0].self_attn.k_proj.kernel
  k[...] = k[...] * 1.5
  try:
    hf_io.save_pretrained(ours, str(tmp_path))
    hf2 = AutoModelForImageTextToText.from_pretrained(str(tmp_path)).eval()
    assert type(hf2) is type(pair[0])
    ids, mask, pix, grid, _ = _inputs(pair, np.random.default_rng(5), [[(56, 84)], [(28, 56)]])
    _check((hf2, ours, None), ids, mask, pix, grid)
    back = hf_io.load_pretrained(str(tmp_path), image_h=56, image_w=84)
    np.testing.assert_array_equal(np.asarray(back(ids, mask, pix, grid)), np.asarray(ours(ids, mask, pix, grid)))
  finally:
    k[...] = k[...] / 1.5
