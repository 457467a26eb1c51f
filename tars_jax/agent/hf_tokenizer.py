"""The agent's token layout through a transformers checkpoint's own tokenizer, chat template and image
processor (`--config.policy.init=hf:<dir>`, issue 28 item 5).

`load_hf_agent(dir, ...)` reads a `qwen2_5_vl` / `qwen3_vl_moe` checkpoint directory as transformers
writes it (config.json, tokenizer.json / tokenizer_config.json, preprocessor_config.json, the chat
template in chat_template.json / chat_template.jinja / tokenizer_config.json) and returns an
`HFAgent`: the `HFTokenizer` (what the agent loop, trajectories, sampler and trainer use of
`ByteTokenizer`: encode / decode / render, pad / bos / eos / image / vision ids, and the episode layout
of `agent/prompts.py`), the `ModelConfig` the checkpoint loads into (`hf_io.config_from_hf`), the
screenshot size and the overrides `hf_io.load_pretrained` needs to build that same config.

Token layout (the module docstring of `agent/prompts.py`, with the pieces rendered by the checkpoint's
chat template; Qwen2.5-VL's template shown, `*…*` model-written):

  <|im_start|>system\\n<system><|im_end|>\\n<|im_start|>user\\n<instruction><|im_end|>\\n    prefix
  <|im_start|>user\\n[<obs text>\\n]<|vision_start|><|image_pad|>*n<|vision_end|><|im_end|>\\n
  <|im_start|>assistant\\n                                                            observation
  *<reply tokens>* *<|im_end|>*                                                          reply
  \\n <|im_start|>user\\n ...                                               TURN_END, observation 2

`<system>` is the UI-TARS system prompt of `prompts.system_prompt` (full form: reply format, one line
per action, the coordinate convention); each screenshot is a user message of its own. The pieces
are found once, by rendering the template on a short conversation and splitting it at known strings;
a template whose rendering does not split that way (no image placeholder for an image item, more
than one token between the reply's end and the next user turn) is refused at start.

Bad input (all raised by `load_hf_agent`, naming what is missing): `HFCheckpointError` for a config
whose `model_type` is not a supported family, a tokenizer without the image placeholder tokens (or
with ids other than config.json's), no image processor config, no chat template, a tokenizer larger
than the model's vocabulary; FileNotFoundError for a missing directory or config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

from tars_jax.agent.grammar import Grammar, free_text_grammar
from tars_jax.models.config import FAMILIES, ModelConfig

HF_PREFIX = "hf:"
# ModelConfig fields that say how to run the model, not what it is: taken from the run's config.model
RUNTIME_FIELDS = ("dtype", "remat", "attention_impl", "attention_block", "moe_impl", "moe_capacity_factor",
                  "moe_dispatch", "moe_decode_kernel", "moe_grouped_blas", "scan_layers")
# config.json key -> the token transformers' Qwen2.5-VL / Qwen3-VL processors write for it
PLACEHOLDERS = (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                ("vision_end_token_id", "<|vision_end|>"))
_INSTR, _TEXT, _REPLY = "@@INSTRUCTION@@", "@@OBSERVATION@@", "@@REPLY@@"  # split markers of the template


class HFCheckpointError(ValueError):
  """A transformers checkpoint directory that `policy.init=hf:<dir>` cannot use; the message names the
  directory and what is missing."""


def hf_dir(init: str) -> str | None:
  """The checkpoint directory (absolute) of a `policy.init` value `hf:<dir>`, or None for any other
  value (a run dir, "")."""
  return os.path.abspath(init[len(HF_PREFIX):]) if init and init.startswith(HF_PREFIX) else None


@dataclasses.dataclass(eq=False)  # hashed by identity (grammar caches key on the tokenizer)
class HFTokenizer:
  """A transformers tokenizer behind the `ByteTokenizer` interface, with the chat layout of the module
  docstring. Build it with `load_hf_agent`.

  vocab_size is the MODEL's vocabulary (config.json `text_config.vocab_size`, >= the tokenizer's
  length): the width of logits and grammar tables. Ids at or above the tokenizer's length are never
  text (decode drops them).
  """

  hf: object  # transformers PreTrainedTokenizerFast
  name: str  # e.g. "hf:Qwen2TokenizerFast" (trajectory records name the tokenizer with it)
  vocab_size: int
  pad_id: int
  bos_id: int  # no BOS in Qwen's layout: the pad id (filler rows of a batch use it)
  eos_id: int  # the token that ends an assistant turn (<|im_end|>)
  image_id: int
  vision_start_id: int
  vision_end_id: int
  turn_start_id: int  # first token of an observation (<|im_start|>)
  turn_end_id: int  # the one token between a reply's EOS and the next observation ("\\n")
  chat_template: str
  special_ids: frozenset  # every added / special token id (never sampled as text)
  _obs: tuple = ()  # (ids before the text, ids after the text up to the image block, ids after it)

  def encode(self, text: str) -> list[int]:
    """Text -> ids (no special tokens added; special-token strings in `text` are NOT parsed as
    specials, so page text cannot forge a turn boundary)."""
    return list(self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

  def decode(self, ids) -> str:
    """Ids -> text; special / added tokens and ids beyond the tokenizer are dropped (never raises)."""
    n = len(self.hf)
    return self.hf.decode([int(i) for i in ids if 0 <= int(i) < n and int(i) not in self.special_ids],
                          skip_special_tokens=True)

  def render(self, ids) -> str:
    """Ids -> text with special tokens shown (logs, trajectory dumps)."""
    n = len(self.hf)
    return self.hf.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=False)

  def _template(self, messages, generation: bool) -> str:
    return self.hf.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                       add_generation_prompt=generation)

  def _fixed(self, text: str) -> list[int]:  # template text: special-token strings ARE specials here
    return list(self.hf(text, add_special_tokens=False)["input_ids"])

  def episode_prefix(self, instruction: str, system: str, memory: Sequence[str] = ()) -> list[int]:
    """The system and instruction messages rendered by the chat template (observation ids). `memory`:
    episodic summaries, as `prompts.encode_episode_prefix` writes them, before the instruction."""
    from tars_jax.agent import prompts  # prompts imports nothing of this module
    mem = (prompts.MEMORY_HEADER + "".join(prompts.memory_line(m).decode("utf-8") for m in memory)) if memory else ""
    text = self._template(_messages(system, _INSTR), generation=False)
    head, tail = text.split(_INSTR)
    return self._fixed(head) + self.encode(mem + instruction) + self._fixed(tail)

  def observation(self, n_img_tokens: int, text: str | None = None, assistant_prefix: str = "",
                  after_reply: bool = False) -> list[int]:
    """One observation as a user message ([text\\n] then the screenshot's IMAGE*n_img_tokens block),
    then the assistant header; after_reply=True prepends TURN_END. Raises ValueError if n < 0."""
    if n_img_tokens < 0:
      raise ValueError(f"n_img_tokens must be >= 0, got {n_img_tokens}")
    before, middle, after = self._obs
    ids = [self.turn_end_id] if after_reply else []
    ids += before + (self.encode(text + "\n") if text else []) + middle
    ids += [self.image_id] * n_img_tokens + after
    return ids + (self.encode(assistant_prefix) if assistant_prefix else [])


def _messages(system: str, instruction: str, *turns) -> list[dict]:
  msgs = [{"role": "system", "content": system}, {"role": "user", "content": instruction}]
  return msgs + list(turns)


def _user_image(text: str | None = None) -> dict:
  content = ([{"type": "text", "text": text}] if text is not None else []) + [{"type": "image"}]
  return {"role": "user", "content": content}


def _read_json(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _chat_template(path: str, tok) -> str | None:
  """The checkpoint's chat template: the processor's (chat_template.json / .jinja, as transformers
  writes them for Qwen2.5-VL / Qwen3-VL) before the tokenizer's."""
  j = _read_json(os.path.join(path, "chat_template.json"))
  if j and j.get("chat_template"):
    return j["chat_template"]
  jinja = os.path.join(path, "chat_template.jinja")
  if os.path.exists(jinja):
    with open(jinja) as f:
      return f.read()
  return getattr(tok, "chat_template", None) or None


def _layout(tok: HFTokenizer, where: str) -> HFTokenizer:
  """Finds the observation pieces, EOS and TURN_END of `tok.chat_template` (module docstring)."""
  sys_ = "S"
  a = tok._template(_messages(sys_, _INSTR), False)
  b = tok._template(_messages(sys_, _INSTR, _user_image(_TEXT)), True)
  c = tok._template(_messages(sys_, _INSTR, _user_image(), {"role": "assistant", "content": _REPLY},
                              _user_image()), True)
  plain = tok._template(_messages(sys_, _INSTR, _user_image()), True)
  img = tok.hf.convert_ids_to_tokens(tok.image_id)
  if not (b.startswith(a) and plain.startswith(a) and c.startswith(plain)):
    raise HFCheckpointError(f"{where}: its chat template does not render a conversation as a prefix of a "
                            "longer one (the layout cannot be split per turn)")
  obs_text, obs = b[len(a):], plain[len(a):]
  if obs.count(img) != 1 or obs_text.count(_TEXT) != 1:
    raise HFCheckpointError(f"{where}: its chat template renders an image item without exactly one {img!r} "
                            "(the image placeholder) in the user message")
  pre_text, post_text = obs_text.split(_TEXT)
  if pre_text + post_text != obs:
    raise HFCheckpointError(f"{where}: its chat template renders a user message's text other than before "
                            "its image")
  rest = c[len(plain):]
  if not (rest.startswith(_REPLY) and rest.endswith(obs)):
    raise HFCheckpointError(f"{where}: its chat template does not write an assistant reply verbatim between "
                            "two user turns")
  end = tok._fixed(rest[len(_REPLY):len(rest) - len(obs)])
  if len(end) != 2 or end[0] not in tok.special_ids:
    raise HFCheckpointError(f"{where}: after a reply its chat template writes {tok.render(end)!r}; supported: "
                            "one end-of-turn special token, then one token before the next user turn")
  mid, after = post_text.split(img)
  before_ids, mid_ids, after_ids = tok._fixed(pre_text), tok._fixed(mid), tok._fixed(after)
  if not mid_ids or mid_ids[-1] != tok.vision_start_id or not after_ids or after_ids[0] != tok.vision_end_id:
    raise HFCheckpointError(f"{where}: its chat template does not wrap the image placeholder in "
                            f"{tok.hf.convert_ids_to_tokens(tok.vision_start_id)!r} ... "
                            f"{tok.hf.convert_ids_to_tokens(tok.vision_end_id)!r}")
  return dataclasses.replace(tok, eos_id=end[0], turn_end_id=end[1], turn_start_id=before_ids[0],
                             _obs=(before_ids, mid_ids, after_ids))


@dataclasses.dataclass(frozen=True)
class HFAgent:
  """What `train.state.build` takes from a checkpoint: tokenizer, model config, screenshot size
  (H, W) in pixels (the image processor's resize of the configured screen size), and the keyword
  overrides under which `hf_io.load_pretrained(path, **load_overrides)` builds `model_cfg`."""
  path: str
  tokenizer: HFTokenizer
  model_cfg: ModelConfig
  image_hw: tuple[int, int]
  load_overrides: dict


def load_hf_agent(path: str, screen_hw: tuple[int, int], runtime: dict | None = None) -> HFAgent:
  """Reads the checkpoint directory `path` (module docstring) and checks it can be used.

  screen_hw: (H, W) pixels of the screenshots before the processor (config.model.image_h / image_w);
    the policy sees them resized as the checkpoint's image processor resizes them (`smart_resize`:
    multiples of patch_size * merge_size, within its min / max pixels).
  runtime: ModelConfig fields of RUNTIME_FIELDS (dtype, moe_impl, ...) to run the model with.
  Raises: FileNotFoundError (no directory / config.json); HFCheckpointError naming what is missing or
    unsupported (module docstring).
  """
  from transformers import AutoTokenizer
  from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
  from tars_jax.models.interop import hf_io

  where = f"policy.init=hf:{path}"
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{where}: no such directory")
  cfg = _read_json(os.path.join(path, "config.json"))
  if cfg is None:
    raise FileNotFoundError(f"{where}: no config.json (a transformers checkpoint directory has one)")
  family = cfg.get("model_type")
  if family not in FAMILIES:
    raise HFCheckpointError(f"{where}: config.json model_type={family!r} is not a supported family; "
                            f"supported: {', '.join(FAMILIES)}")
  if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
    raise HFCheckpointError(f"{where}: no tokenizer (tokenizer.json / tokenizer_config.json)")
  hf_tok = AutoTokenizer.from_pretrained(path)
  vocab = dict(hf_tok.get_vocab())
  missing, ids = [], {}
  for key, token in PLACEHOLDERS:
    want = cfg.get(key)
    got = vocab.get(token)
    if got is None or (want is not None and got != want):
      missing.append(f"{token} (config.json {key}={want}, tokenizer: {'absent' if got is None else got})")
    ids[key] = got
  if missing:
    raise HFCheckpointError(f"{where}: its tokenizer lacks the image placeholder tokens: {'; '.join(missing)}")
  proc = _read_json(os.path.join(path, "preprocessor_config.json"))
  if proc is None:
    raise HFCheckpointError(f"{where}: no preprocessor_config.json (the image processor: patch size, merge "
                            "size, pixel range and normalisation of the screenshots)")
  template = _chat_template(path, hf_tok)
  if not template:
    raise HFCheckpointError(f"{where}: no chat template (chat_template.json, chat_template.jinja or "
                            "tokenizer_config.json chat_template)")
  vc = cfg["vision_config"]
  patch, merge = int(proc.get("patch_size", 14)), int(proc.get("merge_size", 2))
  tpatch = int(proc.get("temporal_patch_size", 2))
  for name, got, want in (("patch_size", patch, vc["patch_size"]), ("merge_size", merge, vc.get("spatial_merge_size", 2)),
                          ("temporal_patch_size", tpatch, vc.get("temporal_patch_size", 2))):
    if got != int(want):
      raise HFCheckpointError(f"{where}: preprocessor_config.json {name}={got} but the model's vision_config "
                              f"has {want}")
  size = proc.get("size") or {}
  lo = proc.get("min_pixels") or size.get("shortest_edge") or 56 * 56
  hi = proc.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
  h, w = smart_resize(int(screen_hw[0]), int(screen_hw[1]), factor=patch * merge, min_pixels=lo, max_pixels=hi)
  overrides = dict(runtime or {}, image_h=int(h), image_w=int(w),
                   image_mean=tuple(float(x) for x in proc["image_mean"]),
                   image_std=tuple(float(x) for x in proc["image_std"]))
  mcfg = hf_io.config_from_hf(cfg, **overrides)
  if len(hf_tok) > mcfg.vocab_size:
    raise HFCheckpointError(f"{where}: its tokenizer has {len(hf_tok)} tokens, more than the model's "
                            f"vocab_size={mcfg.vocab_size}")
  special = frozenset(int(i) for i in hf_tok.added_tokens_decoder) | frozenset(hf_tok.all_special_ids)
  pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id
  tok = HFTokenizer(hf=hf_tok, name=f"hf:{type(hf_tok).__name__}", vocab_size=mcfg.vocab_size, pad_id=int(pad),
                    bos_id=int(pad), eos_id=-1, image_id=ids["image_token_id"],
                    vision_start_id=ids["vision_start_token_id"], vision_end_id=ids["vision_end_token_id"],
                    turn_start_id=-1, turn_end_id=-1, chat_template=template, special_ids=special)
  tok = _layout(tok, where)
  if tok.pad_id in (tok.eos_id, tok.image_id):
    raise HFCheckpointError(f"{where}: its pad token {tok.render([tok.pad_id])!r} is the end-of-turn or image token")
  return HFAgent(path=path, tokenizer=tok, model_cfg=mcfg, image_hw=(int(h), int(w)), load_overrides=overrides)


def free_grammar(tok: HFTokenizer) -> Grammar:
  """The unconstrained reply language over a BPE vocabulary (`grammar.constrained=False`, the only
  mode of `hf:` runs; the format penalty `rl.format_penalty` does the grammar's work): state 0 allows
  every text token of the tokenizer (-> 0) and EOS (-> done); no special / added token (image
  placeholders, <|im_start|>, ...) and no id beyond the tokenizer; done allows only PAD (the reason
  is `agent.grammar.free_grammar`'s: sampler and PPO loss mask the same tokens).
  Returns: Grammar with table [2, vocab_size] int32 (read-only).
  """
  special = set(tok.special_ids)
  text = [i for i in range(min(len(tok.hf), tok.vocab_size)) if i not in special]
  return free_text_grammar(tok.vocab_size, np.asarray(text, np.int64), tok.eos_id, tok.pad_id, "<any text token>*")
