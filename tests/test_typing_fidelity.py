"""tars_jax/analysis/typing_fidelity.py on hand-made episodes, and on real rollout records."""

import numpy as np
import pytest

from tars_jax.agent.prompts import ChatTemplate
from tars_jax.agent.trajectory import Episode, Turn
from tars_jax.analysis import typing_fidelity as tf
from tars_jax.data import records

CLICK = "Thought: \nAction: click(start_box='(450,300)')"


def _type(s):
  return f"Thought: \nAction: type(content='{s}')"


def test_counts_per_block_by_hand():
  eps = [  # (iteration, instruction, turn texts, success)
      (1, 'Enter "Kasie" into the text field and press Submit.', [CLICK, _type("Kasie"), CLICK], True),
      (2, 'Enter "Tora" into the text field and press Submit.', [CLICK, _type("Kasie"), CLICK], False),
      (2, 'Enter "Myron" into the text field and press Submit.', [CLICK, _type("M(#Em")], False),
      (3, 'Enter "Ann" into the text field and press Submit.', [CLICK, "not an action", _type("Ann")], False),
      (4, 'Enter "Lyda" into the text field and press Submit.', [CLICK, CLICK], False),
      (4, "Click the button.", [CLICK], True),  # quotes no text: skipped
      (5, 'Enter "Tora" into the text field and press Submit.', [_type("Tora"), _type("x")], True),
  ]
  got = tf.fidelity(eps, block=3)
  assert got == [tf.Fidelity(1, 3, episodes=4, exact=2, other_target=1, no_type=0, exact_success=1),
                 tf.Fidelity(4, 6, episodes=1, exact=1, other_target=0, no_type=1, exact_success=1)]
  assert tf.fidelity([], block=10) == []
  with pytest.raises(ValueError, match="block"):
    tf.fidelity(eps, block=0)


HW, N_IMG = (12, 16), 4
META = records.DatasetMeta(image_hw=HW, n_img_tokens=N_IMG, tokenizer="byte", vocab_size=264)
TPL = ChatTemplate(n_img_tokens=N_IMG)


def _episode(task, instruction, texts, success, seed):
  turns = []
  for k, text in enumerate(texts):
    reply = TPL.reply(text)
    last = k == len(texts) - 1
    turns.append(Turn(image=np.zeros((*HW, 3), np.uint8), obs_ids=TPL.observation(after_reply=k > 0),
                      reply_ids=reply, logprobs=np.zeros(len(reply), np.float32),
                      states=np.full(len(reply), -1, np.int32), text=text, done=last,
                      env_reward=1.0 if last and success else 0.0))
  return Episode(task=task, seed=seed, instruction=instruction, prefix_ids=TPL.prefix(instruction), turns=turns)


def test_iterations_come_from_the_shard_names(tmp_path):
  d = str(tmp_path / "rollouts")
  enter = 'Enter "Vina" into the text field and press Submit.'
  with records.RecordWriter(d, META, prefix="iter_000001", records_per_shard=1) as w:
    w.write(_episode("miniwob/enter-text", enter, [_type("Vina")], True, 0), source="rollout")
    w.write(_episode("miniwob/click-test", "Click the button.", [CLICK], True, 1), source="rollout")
  with records.RecordWriter(d, META, prefix="iter_000012") as w:
    w.write(_episode("miniwob/enter-text", enter, [CLICK, _type("Vin")], False, 2), source="rollout")
  got = tf.rollout_episodes(d, "miniwob/enter-text")
  assert got == [(1, enter, [_type("Vina")], True), (12, enter, [CLICK, _type("Vin")], False)]
