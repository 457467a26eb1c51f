"""Checkpoint I/O without transformers models: sharded-index loading, mesh placement, the tensor
layouts, and bad input (wrong shape, unknown family, missing / unexpected tensors)."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tars_jax.models import ModelConfig

from tars_jax.models.interop import hf_io
from tars_jax.models.interop.hf_model import HFModel, hf_rope_index

CFG = ModelConfig(image_h=56, image_w=56, patch_size=14, vision_hidden=32, vision_depth=2, vision_heads=2,
                  vision_mlp=48, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=2,
                  moe_intermediate=16, dense_intermediate=40, temporal_patch_size=2, mlp_only_layers=(1,),
                  deepstack_visual_indexes=(1,), mrope_section=(2, 1, 1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("ckpt"))
  model = HFModel(CFG, nnx.Rngs(0))
  hf_io.save_pretrained(model, path)
  return model, path


def _params(model):
  return {tuple(p): np.asarray(v.value) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_layouts_by_name(saved):
  model, path = saved
  t = load_file(os.path.join(path, "model.safetensors"))
  layer = model.policy.trunk.decoder.layers[0]
  gu = t["model.language_model.layers.0.mlp.experts.gate_up_proj"]
  assert gu.shape == (4, 32, 32)  # [E, 2I, D]
  wgu = np.asarray(layer.mlp.w_gate_up[...])  # [E, D, 2, I]: gate, up
  np.testing.assert_array_equal(gu[:, :16].transpose(0, 2, 1), wgu[:, :, 0])
  np.testing.assert_array_equal(gu[:, 16:].transpose(0, 2, 1), wgu[:, :, 1])
  np.testing.assert_array_equal(t["model.language_model.layers.0.self_attn.k_proj.weight"],
                                np.asarray(layer.self_attn.k_proj.kernel[...]).T)
  pe = t["model.visual.patch_embed.proj.weight"]
  assert pe.shape == (32, 3, 2, 14, 14)
  np.testing.assert_array_equal(pe.reshape(32, -1).T, model.policy.trunk.visual.patch_embed.proj.kernel[...])
  assert "model.language_model.layers.1.mlp.gate_proj.weight" in t  # mlp_only_layers -> dense
  assert "model.visual.deepstack_merger_list.0.norm.weight" in t
  assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "qwen3_vl_moe"


def test_sharded_index_and_mesh_placement(saved, tmp_path):
  model, path = saved
  t = load_file(os.path.join(path, "model.safetensors"))
  names = sorted(t)
  halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
  for f, ns in halves.items():
    save_file({n: t[n] for n in ns}, str(tmp_path / f), metadata={"format": "pt"})
  index = {"metadata": {}, "weight_map": {n: f for f, ns in halves.items() for n in ns}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  loaded = hf_io.load_pretrained(str(tmp_path), mesh=mesh, image_h=56, image_w=56)
  want, got = _params(model), _params(loaded)
  assert want.keys() == got.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
  kern = loaded.policy.trunk.decoder.layers[0].self_attn.q_proj.kernel[...]
  assert isinstance(kern.sharding, jax.sharding.NamedSharding) and kern.sharding.mesh == mesh


def test_shape_mismatch_names_tensor_and_shapes(saved, tmp_path):
  _, path = saved
  t = load_file(os.path.join(path, "model.safetensors"))
  name = "model.language_model.layers.0.self_attn.q_proj.weight"
  t[name] = np.zeros((8, 32), np.float32)
  save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
  with pytest.raises(hf_io.CheckpointMismatch, match=r"q_proj.weight.*\(8, 32\).*\(32, 32\)"):
    hf_io.load_pretrained(str(tmp_path))
  del t[name]
  save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(hf_io.CheckpointMismatch, match="lacks 1 tensors.*q_proj"):
    hf_io.load_pretrained(str(tmp_path))
  t[name], t["model.extra.weight"] = np.zeros((32, 32), np.float32), np.zeros(3, np.float32)
  save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(hf_io.CheckpointMismatch, match="unexpected tensor 'model.extra.weight'"):
    hf_io.load_pretrained(str(tmp_path))


def test_unknown_family_lists_known(saved, tmp_path):
  _, path = saved
  cfg = json.load(open(os.path.join(path, "config.json")))
  cfg["model_type"] = "llama"
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"unknown model family 'llama'; known: \['qwen3_vl_moe'"):
    hf_io.load_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match="known"):
    ModelConfig(family="llama")


def test_hf_rope_index_by_hand():
  # BOS a <vs> [2x3 image] <ve> b | padded row with a 1x2 image
  ids = np.array([[1, 2, 260, 9, 9, 9, 9, 9, 9, 261, 3], [0, 0, 0, 0, 0, 1, 260, 9, 9, 261, 4]])
  mask = np.array([[1] * 11, [0] * 5 + [1] * 6])
  pos = hf_rope_index(ids, mask, 9, [(2, 3), (1, 2)])
  np.testing.assert_array_equal(pos[:, 0], [[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
                                            [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
                                            [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]])
  np.testing.assert_array_equal(pos[:, 1, 5:], [[0, 1, 2, 2, 4, 5], [0, 1, 2, 2, 4, 5], [0, 1, 2, 3, 4, 5]])
  assert (pos[:, 1, :5] == 0).all()
  with pytest.raises(ValueError, match="run of 6 tokens"):
    hf_rope_index(ids, mask, 9, [(1, 2), (1, 2)])
