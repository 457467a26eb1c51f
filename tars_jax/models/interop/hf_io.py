"""transformers checkpoints (`qwen3_vl_moe`, `qwen2_5_vl`) in and out: config conversion, tensor name/layout mapping,
`load_pretrained` (abstract model via `nnx.eval_shape`, each safetensors tensor put straight onto
its target device/sharding) and `save_pretrained` (a directory `from_pretrained` loads).

Layouts (transformers `Qwen3VLMoeForConditionalGeneration` state dict <-> ours):
  Linear `weight [out, in]` <-> `kernel [in, out]`; norms' `weight` <-> `scale`; embeddings as is;
  `patch_embed.proj.weight [d, 3, t, p, p]` (Conv3d) <-> Linear kernel [3*t*p*p, d];
  `mlp.gate.weight [E, D]` <-> `mlp.router.kernel [D, E]`;
  `mlp.experts.gate_up_proj [E, 2I, D]` <-> `w_gate_up [E, D, 2, I]` (gate first);
  `mlp.experts.down_proj [E, D, I]` <-> `w_down [E, I, D]`. The expert tensors are also accepted
  in the released checkpoints' transposed layout ([E, D, 2I] / [E, I, D]) as transformers does
  (`conversion_mapping.py`, `Transpose(check_dims=True)`: the in-memory layout wins when both fit).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tars_jax import sharding as sharding_lib
from tars_jax.models.config import FAMILIES, ModelConfig
from tars_jax.models.decoder import split_layer_path, unstack_layer_arrays
from tars_jax.models.interop.hf_model import HFModel


class CheckpointMismatch(ValueError):
  """A checkpoint's config or tensors do not fit the model (names the tensor and both shapes)."""


# --- config ------------------------------------------------------------------------------------------

def _get(d: dict, *names, default=None):
  for n in names:
    if n in d and d[n] is not None:
      return d[n]
  return default


def config_from_hf(hf: dict | Any, **overrides) -> ModelConfig:
  """A transformers config (dict of config.json, or a `PreTrainedConfig`) -> `ModelConfig`.

  image_h / image_w (the fixed size of our `Policy` path) default to the native grid of the
  position table (side * patch_size); `overrides` replace any field.
  Raises ValueError naming the known families for an unknown `model_type`, and CheckpointMismatch
  for settings this code does not implement (attention biases, other activations, ...).
  """
  if hasattr(hf, "to_dict"):
    hf = hf.to_dict()
  family = hf.get("model_type")
  if family not in FAMILIES:
    raise ValueError(f"unknown model family {family!r}; known: {list(FAMILIES)}")
  tc, vc = hf["text_config"], hf["vision_config"]
  rope = _get(tc, "rope_parameters", "rope_scaling", default={}) or {}
  vrope = vc.get("rope_parameters") or {}
  q25 = family == "qwen2_5_vl"
  vact = "silu" if q25 else "gelu_pytorch_tanh"
  checks = [("text_config.attention_bias", tc.get("attention_bias", False), False),
            ("text_config.use_sliding_window", bool(tc.get("use_sliding_window", False)), False),
            ("text_config.hidden_act", tc.get("hidden_act", "silu"), "silu"),
            ("vision_config.hidden_act", vc.get("hidden_act", vact), vact),
            ("vision_config.out_hidden_size", vc.get("out_hidden_size"), tc["hidden_size"]),
            ("vision_config.in_channels", vc.get("in_channels", 3), 3),
            ("text_config.rope_type", rope.get("rope_type", "default"), "default")]
  for name, got, want in checks:
    if got != want:
      raise CheckpointMismatch(f"{name}={got!r} is not supported (need {want!r})")
  heads = tc["num_attention_heads"]
  patch = int(vc["patch_size"])
  if q25:  # dense Qwen2 decoder, window-attention ViT without a position table
    family_fields = dict(experts=0, top_k=1, moe_intermediate=1, head_dim=tc["hidden_size"] // heads,
                         window_size=int(vc.get("window_size", 112)),
                         fullatt_block_indexes=tuple(vc.get("fullatt_block_indexes") or ()))
    side = 16
  else:
    family_fields = dict(
        head_dim=_get(tc, "head_dim", default=tc["hidden_size"] // heads),
        experts=_get(tc, "num_experts", "num_local_experts", default=0), top_k=tc["num_experts_per_tok"],
        moe_intermediate=tc["moe_intermediate_size"], decoder_sparse_step=tc.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(tc.get("mlp_only_layers") or ()), num_position_embeddings=vc["num_position_embeddings"],
        deepstack_visual_indexes=tuple(vc.get("deepstack_visual_indexes") or ()))
    side = int(round(vc["num_position_embeddings"] ** 0.5))
  sec = rope.get("mrope_section")
  d = dict(
      family=family, vocab_size=tc["vocab_size"], hidden=tc["hidden_size"], layers=tc["num_hidden_layers"],
      heads=heads, kv_heads=_get(tc, "num_key_value_heads", default=heads),
      dense_intermediate=tc["intermediate_size"], norm_topk_prob=True,
      rope_theta=float(_get(rope, "rope_theta", default=_get(tc, "rope_theta", default=500000.0))),
      rms_eps=tc.get("rms_norm_eps", 1e-6), mrope_section=None if sec is None else tuple(sec),
      patch_size=patch, temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
      spatial_merge_size=int(vc.get("spatial_merge_size", 2)), vision_hidden=vc["hidden_size"],
      vision_depth=vc["depth"], vision_heads=vc["num_heads"], vision_mlp=vc["intermediate_size"],
      vision_rope_theta=float(vrope.get("rope_theta", 10000.0)),
      image_token_id=hf.get("image_token_id", 151655), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      image_h=side * patch, image_w=side * patch, **family_fields)
  d.update(overrides)
  return ModelConfig(**d)


def config_to_hf(cfg: ModelConfig, **extra):
  """`ModelConfig` -> transformers `Qwen3VLMoeConfig` / `Qwen2_5_VLConfig` (token ids of our byte tokenizer by default;
  `extra` sets top-level fields). Raises CheckpointMismatch for what transformers cannot express."""
  top = dict(image_token_id=cfg.image_token_id, video_token_id=263, vision_start_token_id=260,
             vision_end_token_id=261, tie_word_embeddings=cfg.tie_word_embeddings)
  top.update(extra)
  if cfg.family == "qwen2_5_vl":
    from transformers import Qwen2_5_VLConfig
    text = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.dense_intermediate,
                num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                rms_norm_eps=cfg.rms_eps, use_sliding_window=False, bos_token_id=None, eos_token_id=None,
                tie_word_embeddings=cfg.tie_word_embeddings,
                rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta, mrope_section=list(cfg.sections)))
    vision = dict(depth=cfg.vision_depth, hidden_size=cfg.vision_hidden, intermediate_size=cfg.vision_mlp,
                  num_heads=cfg.vision_heads, patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                  spatial_merge_size=cfg.spatial_merge_size, out_hidden_size=cfg.hidden, hidden_act="silu",
                  window_size=cfg.window_size, fullatt_block_indexes=list(cfg.fullatt_block_indexes),
                  rope_parameters=dict(rope_type="axial", rope_theta=cfg.vision_rope_theta))
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **top)
  from transformers import Qwen3VLMoeConfig
  if not cfg.norm_topk_prob:
    raise CheckpointMismatch("norm_topk_prob=False: transformers' qwen3_vl_moe router always renormalises")
  text = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.dense_intermediate,
              num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
              head_dim=cfg.head_dim, moe_intermediate_size=cfg.moe_intermediate, num_experts=cfg.experts,
              num_experts_per_tok=cfg.top_k, decoder_sparse_step=cfg.decoder_sparse_step,
              mlp_only_layers=list(cfg.mlp_only_layers), rms_norm_eps=cfg.rms_eps,
              rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta,
                                   mrope_section=list(cfg.sections), mrope_interleaved=True))
  vision = dict(depth=cfg.vision_depth, hidden_size=cfg.vision_hidden, intermediate_size=cfg.vision_mlp,
                num_heads=cfg.vision_heads, patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                spatial_merge_size=cfg.spatial_merge_size, out_hidden_size=cfg.hidden,
                num_position_embeddings=cfg.pos_table_side ** 2,
                deepstack_visual_indexes=list(cfg.deepstack_visual_indexes),
                rope_parameters=dict(rope_type="axial", rope_theta=cfg.vision_rope_theta))
  return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **top)


# --- tensor mapping ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One checkpoint tensor: its our-side parameter path, its shape in the checkpoint and the
  conversions (checkpoint array -> our array; our array -> checkpoint array)."""
  hf_name: str
  path: tuple
  hf_shape: tuple[int, ...]
  to_ours: Callable
  to_hf: Callable
  alt_shape: tuple[int, ...] | None = None  # the released checkpoints' layout, converted by to_ours_alt
  to_ours_alt: Callable | None = None


_PREFIX = (("policy", "trunk", "embed_tokens"), "model.language_model.embed_tokens"), \
          (("policy", "trunk", "decoder"), "model.language_model"), \
          (("policy", "trunk", "visual"), "model.visual"), \
          (("policy", "lm_head"), "lm_head")


_Q25_MERGER = {"norm": "ln_q", "linear_fc1": "mlp.0", "linear_fc2": "mlp.2"}  # Qwen2.5-VL merger names


def _hf_stem(path: tuple, family: str = "qwen3_vl_moe") -> str:
  for pre, name in _PREFIX:
    if path[:len(pre)] == pre:
      rest = [str(p) for p in path[len(pre):-1]]
      if family == "qwen2_5_vl" and len(rest) == 2 and rest[0] == "merger":
        rest[1] = _Q25_MERGER[rest[1]]
      return ".".join([name] + rest)
  raise KeyError(f"no checkpoint name for parameter {path}")


def tensor_map(state, temporal_patch_size: int, family: str = "qwen3_vl_moe") -> list[_Tensor]:
  """The checkpoint tensors of an `HFModel` state (abstract or concrete), in a stable order."""
  flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
  out = []
  t2 = lambda a: np.swapaxes(a, -1, -2)
  for path, var in flat.items():
    shape = tuple(var.value.shape)
    stem, leaf = _hf_stem(path, family), path[-1]
    if leaf == "w_gate_up":
      e, d, _, i = shape
      hf = stem.replace(".mlp", ".mlp.experts") + ".gate_up_proj"
      out.append(_Tensor(hf, path, (e, 2 * i, d), lambda a, s=shape: t2(a).reshape(s),
                         lambda a, s=(e, d, 2 * i): t2(a.reshape(s)), (e, d, 2 * i), lambda a, s=shape: a.reshape(s)))
    elif leaf == "w_down":
      e, i, d = shape
      out.append(_Tensor(stem.replace(".mlp", ".mlp.experts") + ".down_proj", path, (e, d, i), t2, t2, (e, i, d),
                         lambda a: a))
    elif path[-2:] == ("router", "kernel"):
      out.append(_Tensor(stem.replace(".router", ".gate") + ".weight", path, shape[::-1], lambda a: a.T,
                         lambda a: a.T))
    elif path[-3:] == ("patch_embed", "proj", "kernel"):
      n_in, dv = shape
      p = int(round((n_in // 3 // temporal_patch_size) ** 0.5))
      hf_shape = (dv, 3, temporal_patch_size, p, p)
      out.append(_Tensor(stem + ".weight", path, hf_shape, lambda a: a.reshape(a.shape[0], -1).T,
                         lambda a, s=hf_shape: a.T.reshape(s)))
    elif leaf == "kernel":
      out.append(_Tensor(stem + ".weight", path, shape[::-1], lambda a: a.T, lambda a: a.T))
    elif leaf in ("scale", "embedding"):
      out.append(_Tensor(stem + ".weight", path, shape, lambda a: a, lambda a: a))
    elif leaf == "pos_embed":
      out.append(_Tensor(_hf_stem(path) + ".pos_embed.weight", path, shape, lambda a: a, lambda a: a))
    elif leaf == "bias":
      out.append(_Tensor(stem + ".bias", path, shape, lambda a: a, lambda a: a))
    else:
      raise KeyError(f"no checkpoint mapping for parameter {path}")
  return out


# --- load / save -------------------------------------------------------------------------------------

def canonical_name(name: str) -> str:
  """transformers' current state-dict name of a checkpoint tensor: released Qwen2.5-VL / Qwen2-VL
  checkpoints (and transformers' own save of them) use `model.layers...` / `visual...`, i.e. without
  the `language_model` level (transformers renames them on load the same way)."""
  if name.startswith("visual."):
    return "model." + name
  if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
    return "model.language_model." + name[len("model."):]
  return name


def _weight_files(path: str) -> list[str]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(path, f) for f in files]
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(single):
    return [single]
  raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_pretrained(path: str, mesh: jax.sharding.Mesh | None = None, dtype=jnp.float32,
                    partition: Callable[[str, tuple[int, ...]], jax.sharding.PartitionSpec] | None = None,
                    rules=None, **overrides) -> HFModel:
  """A transformers checkpoint directory (config.json + model.safetensors or a sharded index) ->
  `HFModel` whose `__call__(input_ids, attention_mask, pixel_values, image_grid_thw)` returns logits.

  The model is built abstractly (`nnx.eval_shape`), then each tensor is read alone, converted to our
  layout, cast to `dtype` and `device_put` to its target: with a mesh, the NamedSharding the
  logical-axis `rules` (`tars_jax.sharding`, default `DEFAULT_RULES`) give the parameter, or
  `partition(name, shape)` when that callable is given; without a mesh, the default device.
  `overrides` replace ModelConfig fields (e.g. image_h / image_w of the `Policy` path, `moe_impl`,
  `scan_layers=True`: the per-layer / per-block checkpoint tensors are stacked on the host into the
  [layers, ...] / [vision_depth, ...] parameters, then each stacked parameter is `device_put` to its sharding).
  Raises CheckpointMismatch naming the tensor and both shapes (or the missing / unexpected
  tensors), ValueError listing the known families for an unknown model_type, ShardingError when
  a mesh axis does not divide a parameter's dimension.
  """
  from safetensors import safe_open
  with open(os.path.join(path, "config.json")) as f:
    cfg = config_from_hf(json.load(f), dtype=jnp.dtype(dtype).name, **overrides)
  abstract = nnx.eval_shape(lambda: HFModel(cfg, nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  specs = {t.hf_name: t for t in tensor_map(_per_layer_state(cfg, state), cfg.temporal_patch_size, cfg.family)}
  targets = None
  if mesh is not None and partition is None:  # each parameter's sharding from its logical axes
    targets = {tuple(p): v.value for p, v in nnx.to_flat_state(sharding_lib.logical_to_sharding(state, mesh, rules))}
  values: dict[tuple, jax.Array] = {}
  pending: dict[tuple, dict[int, np.ndarray]] = {}  # scan_layers: per-layer host arrays until all are read
  seen = set()
  for file in _weight_files(path):
    with safe_open(file, framework="flax") as f:
      for file_name in f.keys():
        name = canonical_name(file_name)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
          continue  # a tied head may still be written out; it is the embedding matrix
        if name not in specs:
          raise CheckpointMismatch(f"unexpected tensor {file_name!r} in {file} (not part of a {cfg.family} model "
                                   f"with this config)")
        spec = specs[name]
        a = np.asarray(f.get_tensor(file_name), np.float32)
        if tuple(a.shape) == spec.hf_shape:
          x = spec.to_ours(a)
        elif spec.alt_shape is not None and tuple(a.shape) == spec.alt_shape:
          x = spec.to_ours_alt(a)
        else:
          raise CheckpointMismatch(f"tensor {file_name!r}: checkpoint shape {tuple(a.shape)}, model expects "
                                   f"{spec.hf_shape}")
        seen.add(name)
        p = spec.path
        sp = split_layer_path(p) if cfg.scan_layers else None
        if sp is not None:  # stack on the host, place once all layers are in
          p = sp[0] + sp[2]
          pending.setdefault(p, {})[sp[1]] = x
          n = cfg.layers if sp[0][-1] == "layers" else cfg.vision_depth
          if len(pending[p]) < n:
            continue
          by_layer = pending.pop(p)
          x = np.stack([by_layer[i] for i in range(n)])
        if mesh is None:
          sharding = None
        elif partition is not None:
          spec_ = partition(name, x.shape[1:] if sp is not None else x.shape)
          sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, *spec_) if sp is not None
                                                else spec_)
        else:
          sharding = targets[p]
        x = jnp.asarray(x, dtype) if sharding is None else x.astype(jnp.dtype(dtype))
        values[p] = jax.device_put(x, sharding) if sharding is not None else x
  missing = sorted(set(specs) - seen)
  if missing:
    raise CheckpointMismatch(f"checkpoint lacks {len(missing)} tensors: {missing[:8]}")
  flat = nnx.to_flat_state(state)
  for p, var in flat:
    var.value = values[tuple(p)]
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


_STACKED = (("policy", "trunk", "decoder", "layers"), ("policy", "trunk", "visual", "blocks"))


def _per_layer_state(cfg: ModelConfig, state):
  """`state` itself, or for `cfg.scan_layers` the abstract state of the same model with unscanned
  layers (per-layer paths `... "layers", i, ...`), the layout the checkpoint names follow."""
  if not cfg.scan_layers:
    return state
  cfg_u = dataclasses.replace(cfg, scan_layers=False)
  return nnx.state(nnx.eval_shape(lambda: HFModel(cfg_u, nnx.Rngs(0))), nnx.Param)


def save_pretrained(model: HFModel, path: str, config_extra: dict | None = None) -> None:
  """Writes config.json + model.safetensors (float32, transformers' in-memory layout) that
  `Qwen3VLMoeForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration.from_pretrained(path)`
  loads to the same function. `config_extra`: top-level config fields (e.g. the placeholder token
  ids of the tokenizer the model was trained with; default: our byte tokenizer's)."""
  from safetensors.numpy import save_file
  os.makedirs(path, exist_ok=True)
  cfg = model.cfg
  config_to_hf(cfg, **(config_extra or {})).save_pretrained(path)
  state = nnx.state(model, nnx.Param)
  flat = {tuple(p): np.asarray(v.get_value(), np.float32) for p, v in nnx.to_flat_state(state)}
  if cfg.scan_layers:  # stacked [layers, ...] / [vision_depth, ...] parameters -> one entry per layer
    flat = unstack_layer_arrays(flat, {p for p in flat if p[:4] in _STACKED})
  tensors = {}
  for spec in tensor_map(_per_layer_state(cfg, state), cfg.temporal_patch_size, cfg.family):
    a = spec.to_hf(flat[spec.path])
    tensors[spec.hf_name] = np.ascontiguousarray(a)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


TOKEN_ID_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# files of a checkpoint directory that are not weights or config: tokenizer, processor, chat template
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "merges.txt", "preprocessor_config.json", "video_preprocessor_config.json",
               "processor_config.json", "chat_template.json", "chat_template.jinja", "generation_config.json")


def export_policy(policy_params, cfg: ModelConfig, source: str, path: str) -> None:
  """A trained policy (the `nnx.State` of a `Policy` of `cfg`, e.g. a train state's "policy" restored
  from an Orbax checkpoint) of a run started from the transformers checkpoint `source`
  (`policy.init=hf:<source>`) -> a checkpoint directory `path` that transformers loads: weights and
  config as `save_pretrained` writes them, with `source`'s placeholder token ids, and `source`'s
  tokenizer, processor and chat template files copied as they are.
  Raises: FileNotFoundError when `source` has no config.json; CheckpointMismatch as `save_pretrained`."""
  import shutil
  with open(os.path.join(source, "config.json")) as f:
    src = json.load(f)
  model = nnx.eval_shape(lambda: HFModel(cfg, nnx.Rngs(0)))
  nnx.update(model.policy, policy_params)
  save_pretrained(model, path, {k: src[k] for k in TOKEN_ID_FIELDS if src.get(k) is not None})
  for name in _SIDE_FILES:
    if os.path.exists(os.path.join(source, name)):
      shutil.copyfile(os.path.join(source, name), os.path.join(path, name))


def load_processor(path: str):
  """transformers' `AutoProcessor` (image processor + tokenizer) of a checkpoint directory, or its
  tokenizer alone, or None when the directory has neither."""
  from transformers import AutoProcessor, AutoTokenizer
  if os.path.exists(os.path.join(path, "preprocessor_config.json")):
    return AutoProcessor.from_pretrained(path)
  if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
    return AutoTokenizer.from_pretrained(path)
  return None
