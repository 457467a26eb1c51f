"""Image dependence of a policy's decisions (tars_jax/analysis/image_dependence.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.configs.miniwob_ppo import get_config
from tars_jax.agent import prompts
from tars_jax.agent.grammar import walk
from tars_jax.agent.trajectory import Episode, Turn, collate
from tars_jax.analysis.image_dependence import decision_mask, image_dependence, layer_states
from tars_jax.models.rope import rope_positions
from tars_jax.train.state import build


@pytest.fixture(scope="module")
def setup():
  cfg = get_config("smoke")
  parts = build(cfg)
  params = parts.init_state(0)["policy"]
  return cfg, parts, params


CLICKS = [(100, 200), (500, 500), (900, 800), (300, 700)]  # 4 rows everywhere: one compiled shape


def _batch(parts, images, clicks):
  tok = parts.tokenizer
  eps = []
  for img, (x, y) in zip(images, clicks):
    prefix = prompts.encode_episode_prefix(tok, "Click the button.", parts.loop_cfg.system)
    obs = prompts.encode_observation(tok, parts.loop_cfg.n_img_tokens, None)
    rep = tok.encode(f"Thought: \nAction: click(start_box='({x:03d},{y:03d})')") + [tok.eos_id]
    ep = Episode(task="t", seed=0, instruction="Click the button.", prefix_ids=prefix)
    ep.turns.append(Turn(image=img, obs_ids=obs, reply_ids=rep, logprobs=np.zeros(len(rep), np.float32),
                         states=walk(parts.grammar, rep)))
    eps.append(ep)
  return collate(eps, pad_id=tok.pad_id, max_images=1, image_hw=parts.image_hw, length_multiple=64,
                 batch_size=len(eps)).as_dict()


@functools.lru_cache(maxsize=None)
def _logits_fn(graphdef):
  return jax.jit(lambda p, *a: nnx.merge(graphdef, p)(*a).logits)


def _forward(parts, params, b, pix, im):
  """The policy's own logits [B, T, V] (`Policy.__call__`, jitted: eager NNX is slow)."""
  toks, attn = jnp.asarray(b["tokens"]), jnp.asarray(b["attn_mask"])
  pos = rope_positions(toks, attn, parts.inputs.image_token_id, parts.inputs.grid_hw)
  return _logits_fn(parts.policy_gd)(params, toks, pos, attn, jnp.asarray(pix), jnp.asarray(im))


def _dep(parts, params, batch):
  return image_dependence(parts.policy_gd, params, batch, parts.table, image_token_id=parts.inputs.image_token_id,
                          grid_hw=parts.inputs.grid_hw)


def _images(n, seed):
  h, w = (get_config("smoke").model.image_h, get_config("smoke").model.image_w)
  return list(np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8))


def test_decisions_are_the_free_digits(setup):
  _, parts, _ = setup
  b = _batch(parts, _images(2, 0), [(120, 560), (700, 330)])
  q = decision_mask(b, parts.table)
  tgt = np.asarray(b["tokens"])[:, 1:]
  # 'tens3' coordinates: two free digits each for x and y (the third is forced to 0), then EOS is
  # forced after ')'... so exactly the 4 leading digits of each reply are decisions.
  for r, (x, y) in enumerate([(120, 560), (700, 330)]):
    assert bytes(tgt[r][q[r]].tolist()).decode() == f"{x:03d}"[:2] + f"{y:03d}"[:2]


def test_layer_walk_reproduces_the_policy_forward(setup):
  _, parts, params = setup
  b = _batch(parts, _images(4, 1), CLICKS)
  toks, attn = jnp.asarray(b["tokens"]), jnp.asarray(b["attn_mask"])
  pos = rope_positions(toks, attn, parts.inputs.image_token_id, parts.inputs.grid_hw)
  walk_fn = jax.jit(lambda p, *a: dict(layer_states(nnx.merge(parts.policy_gd, p), *a)))
  states = walk_fn(params, toks, pos, attn, jnp.asarray(b["pixel_values"]), jnp.asarray(b["image_mask"]))
  ref = _forward(parts, params, b, b["pixel_values"], b["image_mask"])
  m = np.asarray(attn)
  ref, got = np.asarray(ref)[m], np.asarray(states["logits"])[m]
  np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * max(1.0, np.abs(ref).max()))


def test_same_screenshot_everywhere_gives_zero(setup):
  _, parts, params = setup
  img = _images(1, 2)[0]
  res = _dep(parts, params, _batch(parts, [img] * 4, CLICKS))
  for k in res:
    if k != "decisions":
      assert res[k] < 1e-6, (k, res[k])
  assert res["decisions"] == 16


def test_tv_equals_two_independent_forwards(setup):
  """`tv` against float64 numpy over two full `Policy` forwards (rows' images rolled by one)."""
  cfg, parts, params = setup
  b = _batch(parts, _images(4, 3), CLICKS)
  res = _dep(parts, params, b)
  pix, im = np.asarray(b["pixel_values"]), np.asarray(b["image_mask"])
  la = np.asarray(_forward(parts, params, b, pix, im), np.float64)[:, :-1]
  lb = np.asarray(_forward(parts, params, b, np.roll(pix, -1, 0), np.roll(im, -1, 0)), np.float64)[:, :-1]
  q = decision_mask(b, parts.table)
  allowed = np.asarray(parts.table)[np.maximum(np.asarray(b["states"]), 0)] >= 0
  tvs = []
  for r, t in zip(*np.nonzero(q)):
    a = np.where(allowed[r, t], la[r, t], -np.inf)
    c = np.where(allowed[r, t], lb[r, t], -np.inf)
    pa, pc = np.exp(a - a.max()), np.exp(c - c.max())
    tvs.append(0.5 * np.abs(pa / pa.sum() - pc / pc.sum()).sum())
  assert res["decisions"] == len(tvs) == 16
  np.testing.assert_allclose(res["tv"], np.mean(tvs), rtol=1e-4, atol=1e-7)
  assert res["tv"] > 0


def test_a_policy_blind_to_pixels_measures_zero(setup):
  """Zeroing the vision merger's output layer makes every screenshot the same to the decoder: 0;
  the same batch through the random-init policy depends on its images (> 0 at every layer)."""
  _, parts, params = setup
  b = _batch(parts, _images(4, 4), CLICKS)
  seeing = _dep(parts, params, b)
  blind = nnx.merge(parts.policy_gd, params)
  fc2 = blind.trunk.visual.merger.linear_fc2
  fc2.kernel.value = jnp.zeros_like(fc2.kernel.value)
  fc2.bias.value = jnp.zeros_like(fc2.bias.value)
  for m in blind.trunk.visual.deepstack_merger_list:
    m.linear_fc2.kernel.value = jnp.zeros_like(m.linear_fc2.kernel.value)
  _, blind_params = nnx.split(blind)
  res = _dep(parts, blind_params, b)
  layers = [k for k in res if k.startswith("layer") or k == "final"]
  assert layers and all(res[k] < 1e-6 for k in layers) and res["tv"] < 1e-6
  assert all(seeing[k] > 1e-4 for k in layers) and seeing["tv"] > 1e-5


def test_bad_batches_raise(setup):
  _, parts, params = setup
  one = _batch(parts, _images(1, 5), [(100, 200)])
  with pytest.raises(ValueError, match="at least 2 rows"):
    _dep(parts, params, one)
