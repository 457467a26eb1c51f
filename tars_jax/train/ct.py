"""Continual pre-training (CT) on trajectory records: next-token loss on every text token.

In the UI-TARS-2 data flywheel (report sections 2.3-2.4) the trajectories the validator rejects
(V = 0) are not thrown away: they go to the CT set, and the model is retrained CT -> SFT -> RL on the
grown sets, CT "emphasizing broad knowledge acquisition" and SFT the verified replies; "during both CT
and SFT, agent-specific data is mixed with general-purpose data" (2.3). This module holds the pure
parts of CT; the trainer is `experiments/sft.py` (`sft.ct_data`, `sft.ct_ratio`), which mixes CT
batches into the SFT stream.

What CT trains on: the whole token view of a recorded episode (`trajectory.collate`), as language
modelling: the prefix (system prompt, instruction, episodic memory), every observation's text and the
chat template's structure tokens (TURN_START / TURN_END, VISION_START / VISION_END), and the replies
as they were written — never the IMAGE placeholder tokens (they stand for pixels, whose features the
vision tower splices in; the screenshots are context only) and never padding (`text_mask`).

Loss: cross-entropy under the full-vocabulary softmax at every position, replies included, not the
grammar-constrained one of SFT (`sft.loss_and_metrics`). Three reasons: (1) CT is pre-training, the
likelihood of the sequence under the model's own distribution, and observation text has no grammar,
so one distribution for all positions keeps the loss a proper next-token log-likelihood; (2) CT
trajectories are the rejected ones, whose replies may be invalid actions the grammar does not accept
(a target the grammar forbids has log-prob -1e9 under the constrained softmax, and `sft.prepare`
refuses such replies outright); (3) what the policy samples is still grammar-constrained, so the
extra mass CT moves onto grammar-illegal tokens never reaches an action. Token-mean over the batch's
text tokens (as `sft.loss_and_metrics` takes the mean over reply tokens).

Replies are kept as recorded (`prepare`): the ids the model wrote, thoughts included whatever
`sft.thoughts` says (CT learns what was written; the thought choice is about the SFT target).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode
from tars_jax.train import sft
from tars_jax.train import step as step_lib
from tars_jax.train.step import ModelInputs


def prepare(ep: Episode, *, tokenizer: ByteTokenizer) -> Episode:
  """A recorded episode as CT trains on it: each turn's `reply_ids` as recorded (what the model wrote,
  an unparseable reply included), or — for a record written with text only (no ids) — its text's
  bytes + EOS; grammar states and behaviour log-probs 0 (unused: full-vocabulary softmax), per-token
  staleness masks of streaming rollouts dropped (CT trains every text token).

  Returns a new Episode (the input is not modified).
  """
  turns = []
  for t in ep.turns:
    ids = list(t.reply_ids) if len(t.reply_ids) or not t.text else tokenizer.encode(t.text) + [tokenizer.eos_id]
    turns.append(dataclasses.replace(t, reply_ids=ids, states=np.zeros(len(ids), np.int32),
                                     logprobs=np.zeros(len(ids), np.float32), loss_mask=None, versions=None))
  return dataclasses.replace(ep, turns=turns)


def text_mask(tokens, attn_mask, image_id: int) -> np.ndarray:
  """The CT loss mask of a collated batch, in target alignment (`trajectory.Batch`).

  tokens: [B, T] int32, attn_mask: [B, T] bool (True on real tokens).
  Returns [B, T-1] float32: 1 where target token j+1 is a real token and not an IMAGE placeholder
  (the prefix after BOS, observation text and structure tokens, reply tokens), 0 on image slots and
  padding.
  """
  tokens, attn_mask = np.asarray(tokens), np.asarray(attn_mask)
  target, real = tokens[:, 1:], attn_mask[:, 1:]
  return (real & (target != image_id)).astype(np.float32)


def with_text_mask(batch: dict, image_id: int) -> dict:
  """A collated batch dict plus its `text_mask` [B, T-1] float32 (the key `loss_and_metrics` reads;
  `loss_mask`, the reply tokens, is kept as it is)."""
  return dict(batch, text_mask=text_mask(batch["tokens"], batch["attn_mask"], image_id))


def loss_and_metrics(params, batch: dict, *, graphdef, inputs: ModelInputs, aux_coef: float):
  """(loss, metrics): the SFT loss (`sft.loss_and_metrics`) with `batch["text_mask"]` as its mask and
  no grammar (full-vocabulary softmax) + aux_coef * MoE load-balance loss (module docstring).

  batch: a collated `trajectory.Batch` dict with `text_mask` [B, T-1] float32 (`with_text_mask`).
  metrics (float32 scalars): ct_ce (per CT text token, nats), ct_acc (arg-max = target on text
  tokens), ct_tokens (text tokens), ct_aux.
  """
  loss, m = sft.loss_and_metrics(params, dict(batch, loss_mask=batch["text_mask"]), None, graphdef=graphdef,
                                 inputs=inputs, aux_coef=aux_coef)
  # without a grammar every masked token is a free decision: acc_free is the accuracy on text tokens
  return loss, {"ct_ce": m["ce"], "ct_acc": m["acc_free"], "ct_tokens": m["tokens"], "ct_aux": m["aux"]}


def train_step(params, opt_state, batch: dict, *, graphdef, opt, inputs: ModelInputs, aux_coef: float):
  """One CT update (`step.update`; same optimiser and state as `sft.train_step`). Returns (params,
  opt_state, metrics of `loss_and_metrics` + ct_loss, ct_grad_norm): every name `ct_`-prefixed, so a
  log row can hold an SFT and a CT step's metrics side by side."""
  loss_fn = step_lib.bind(loss_and_metrics, graphdef=graphdef, inputs=inputs, aux_coef=aux_coef)
  params, opt_state, m = step_lib.update(params, opt_state, batch, loss_fn=loss_fn, opt=opt)
  m = dict(m)
  m["ct_loss"], m["ct_grad_norm"] = m.pop("loss"), m.pop("grad_norm")
  return params, opt_state, m
