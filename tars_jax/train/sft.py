"""Supervised fine-tuning (SFT, and the CT-style grounding stage) of the policy on trajectory records.

UI-TARS-2 never starts RL from scratch: the policy is first trained by cross-entropy on demonstrations
and grounding data (report sections 2.3-2.4, "cold start"), then its critic is pretrained (2.5.4), then
PPO runs. This module holds the pure parts of that stage: turning a recorded episode into the token
view the policy is trained on (`prepare`), the loss, and the jitted update. The trainer is
`experiments/sft.py`, which also mixes in continual pre-training on all text tokens of the
flywheel's CT set (`train/ct.py`).

Loss: cross-entropy of the model-written tokens (`loss_mask` = reply bytes and their EOS; never the
prompt, observation or image tokens) under the run's grammar: the log-softmax is taken over the tokens
the grammar allows at each position (`losses.masked_log_softmax`), the distribution the policy samples
from, so grammar-forced tokens (one allowed token) cost 0 and carry no gradient. Token-mean over the
batch's reply tokens (verl `sft_trainer` aggregates the same way).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tars_jax.agent.grammar import Grammar, walk
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode, collate
from tars_jax.data import pipeline, records
from tars_jax.train import step as step_lib
from tars_jax.train.step import ModelInputs

_REPLY = re.compile(r"^Thought: (?P<thought>[^\n]*)\nAction: (?P<action>.*)$", re.S)


class ReplyNotInGrammar(ValueError):
  """A recorded reply the run's grammar does not accept (another action set, coordinate format or
  length limit than the records were written for)."""


def reply_text(text: str, thoughts: bool) -> str:
  """The reply to train on: `text` as recorded (thoughts=True) or with an empty thought
  (`Thought: \\nAction: <action>`, thoughts=False). Raises ValueError if `text` is not of the form
  `Thought: <one line>\\nAction: <action>`."""
  m = _REPLY.match(text)
  if m is None:
    raise ValueError(f"reply {text!r} is not 'Thought: <thought>\\nAction: <action>'")
  return text if thoughts else f"Thought: \nAction: {m['action']}"


def prepare(ep: Episode, *, grammar: Grammar, tokenizer: ByteTokenizer, thoughts: bool) -> Episode:
  """A recorded episode re-encoded for training: every turn's reply from its text (`reply_text`),
  ids = bytes + EOS, grammar states from `walk`, behaviour log-probs 0 (unused by SFT).

  Returns a new Episode (the input is not modified).
  Raises: ReplyNotInGrammar naming the task, seed, turn and reply when the grammar rejects a reply.
  """
  turns = []
  for k, t in enumerate(ep.turns):
    text = reply_text(t.text, thoughts)
    ids = tokenizer.encode(text) + [tokenizer.eos_id]
    states = walk(grammar, ids)
    if (states < 0).any():
      raise ReplyNotInGrammar(f"{ep.task} seed {ep.seed} turn {k}: reply {text!r} is not accepted by the "
                              "run's grammar (config.grammar: actions, coord_format, max_*_bytes)")
    turns.append(dataclasses.replace(t, text=text, reply_ids=ids, states=states,
                                     logprobs=np.zeros(len(ids), np.float32)))
  return dataclasses.replace(ep, turns=turns)


def check_data(dirs: Sequence[str], *, image_hw: tuple[int, int], n_img_tokens: int,
               tokenizer: ByteTokenizer) -> records.DatasetMeta:
  """Checks, before any step, that record dirs can train this model; returns their DatasetMeta.

  Raises: ValueError for no dirs; FileNotFoundError for a dir that is not a records dataset;
    records.DatasetMismatch naming the field (image size, image slots, tokenizer, vocabulary) with
    the dataset's and the model's values, or two dirs that differ; records.EmptyDataset when they
    hold no records.
  """
  if not dirs:
    raise ValueError("no record dirs to train on (config.sft.data is empty)")
  meta = records.load_meta(list(dirs))
  model = records.DatasetMeta.for_model(image_hw, n_img_tokens, tokenizer)
  records.check_compatible(meta, **dataclasses.asdict(model))
  if not sum(shard["records"] for d in dirs for shard in records.read_index(d)["shards"]):
    raise records.EmptyDataset(f"no records in {list(dirs)}")
  return meta


def collate_demos(episodes: Sequence[Episode], *, prep, pad_id: int, image_hw: tuple[int, int], length_multiple: int,
                  batch_size: int) -> dict:
  """Recorded episodes -> a training batch dict (`trajectory.Batch`), replies re-encoded by `prep`
  (`prepare`, or `ct.prepare`); image slots per row = the batch's most turns rounded up to a power of
  two (few jit shapes; the vision tower runs on every slot, so not the longest demonstration's count
  for every batch). batch_size: rows (padded with empty rows); image_hw: (height, width) pixels."""
  eps = [prep(e) for e in episodes]
  turns = max(len(e.turns) for e in eps)
  return collate(eps, pad_id=pad_id, max_images=1 << (turns - 1).bit_length(), image_hw=image_hw,
                 length_multiple=length_multiple, batch_size=batch_size).as_dict()


def demo_batches(dirs: Sequence[str], *, grammar: Grammar, tokenizer: ByteTokenizer, thoughts: bool,
                 image_hw: tuple[int, int], length_multiple: int, batch_size: int, seed: int):
  """An endless, shuffled, length-bucketed stream of SFT batches (`collate_demos` of `prepare`d
  episodes) of the records in `dirs`: the demonstrations of PPO-ptx (`ppo.ppo_update(ptx_batches=)`).
  Returns a grain IterDataset (`pipeline.batches`); its iterator's get_state() / set_state() resume
  exactly. Raises: FileNotFoundError / records.EmptyDataset for dirs that hold no records."""
  prep = functools.partial(prepare, grammar=grammar, tokenizer=tokenizer, thoughts=thoughts)
  coll = functools.partial(collate_demos, prep=prep, pad_id=tokenizer.pad_id, image_hw=image_hw,
                           length_multiple=length_multiple, batch_size=batch_size)
  return pipeline.batches(records.episodes(tuple(dirs)), seed=seed, batch_size=batch_size, collate_fn=coll,
                          shuffle=True, length_multiple=length_multiple)


def make_optimizer(lr: float, warmup_steps: int, total_steps: int, final_fraction: float,
                   max_grad_norm: float, weight_decay: float) -> optax.GradientTransformation:
  """Global-norm clipping + AdamW; lr: linear warm-up over `warmup_steps` to `lr`, then cosine decay
  to `final_fraction * lr` at `total_steps`. Same state tree as `ppo.make_optimizer` (so an SFT
  checkpoint restores into the train state of `state.Parts.init_state`)."""
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup_steps), max(total_steps, warmup_steps + 1),
                                             end_value=lr * final_fraction)
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(lambda s: sched(s + 1), b1=0.9, b2=0.999, weight_decay=weight_decay))


def token_logp(params, batch: dict, table, *, graphdef, inputs: ModelInputs, image_features=None):
  """Log-probs of the target tokens under the grammar-constrained distribution at temperature 1
  (the full vocabulary where `table` is None).

  batch: a collated `trajectory.Batch` dict (tokens [B, T] int32, loss_mask / states [B, T-1], images).
  image_features: None, or the screenshots' features as constants (`step.forward`).
  Returns (logp [B, T-1] float32, allowed_count [B, T-1] int32 (tokens the grammar allows; 1 = forced),
  correct [B, T-1] bool (the target is the arg-max), aux_loss scalar).
  """
  out = step_lib.forward(graphdef, params, batch, inputs, image_features=image_features)
  allowed = step_lib.allowed_tokens(table, batch["states"], batch["loss_mask"])
  logp, logp_all = step_lib.target_logp(out.logits, batch["tokens"], allowed)
  target = batch["tokens"][:, 1:]
  n_allowed = allowed.sum(-1) if allowed is not None else jnp.full(target.shape, logp_all.shape[-1])
  return logp, n_allowed, jnp.argmax(logp_all, -1) == target, out.aux_loss


def loss_and_metrics(params, batch: dict, table, *, graphdef, inputs: ModelInputs, aux_coef: float,
                     image_features=None):
  """(loss, metrics): token-mean cross-entropy over the `loss_mask` tokens + aux_coef * MoE
  load-balance loss. SFT: the reply tokens under the grammar `table`; CT (`ct.loss_and_metrics`):
  every text token, table None (the full vocabulary). image_features: as in `token_logp`.

  metrics (float32 scalars): ce (per masked token, nats), ce_free (per free decision: positions where
  the grammar allows more than one token), acc_free (arg-max = target at free decisions), tokens
  (masked tokens), free (free decisions), aux.
  """
  logp, n_allowed, correct, aux = token_logp(params, batch, table, graphdef=graphdef, inputs=inputs,
                                             image_features=image_features)
  mask = batch["loss_mask"]
  free = mask * (n_allowed > 1)
  n, nf = jnp.maximum(mask.sum(), 1.0), jnp.maximum(free.sum(), 1.0)
  ce = -(logp * mask).sum() / n
  m = {"ce": ce, "ce_free": -(logp * free).sum() / nf, "acc_free": (correct * free).sum() / nf,
       "tokens": mask.sum(), "free": free.sum(), "aux": aux}
  return ce + aux_coef * aux, m


def train_step(params, opt_state, batch: dict, table, *, graphdef, opt, inputs: ModelInputs, aux_coef: float):
  """One SFT update (`step.update` of `loss_and_metrics`; table None = the full vocabulary, as the
  ORM trains). Returns (params, opt_state, metrics incl. loss and grad_norm)."""
  loss_fn = step_lib.bind(loss_and_metrics, graphdef=graphdef, inputs=inputs, aux_coef=aux_coef)
  return step_lib.update(params, opt_state, batch, table, loss_fn=loss_fn, opt=opt)


@functools.partial(jax.jit, static_argnames=("graphdef", "inputs"))
def eval_metrics(params, batch: dict, table, *, graphdef, inputs: ModelInputs) -> dict[str, Any]:
  """The metrics of `loss_and_metrics` without an update (held-out records)."""
  return loss_and_metrics(params, batch, table, graphdef=graphdef, inputs=inputs, aux_coef=0.0)[1]
