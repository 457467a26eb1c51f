"""Chat template: exact token sequences and loss masks, worked by hand; system prompt vs grammar."""

import numpy as np
import pytest

from tars_jax.agent import actions as A
from tars_jax.agent import prompts
from tars_jax.agent.grammar import ALL_ACTIONS, SDK_ACTIONS, accepts, build_grammar
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode, Turn, episode_arrays
from tests.test_grammar import CLASSES, SDK_CLASSES

TOK = ByteTokenizer()
BOS, EOS, IMG, VS, VE, TS, TE = 257, 258, 259, 260, 261, 262, 263


def test_prefix_and_observation_tokens_by_hand():
  S, H, i, NL = ord("S"), ord("H"), ord("i"), 10
  assert prompts.encode_episode_prefix(TOK, "Hi", "S") == [BOS, S, NL, H, i, NL]
  assert prompts.encode_episode_prefix(TOK, "Hi", "") == [BOS, H, i, NL]
  assert prompts.encode_observation(TOK, 3) == [TS, VS, IMG, IMG, IMG, VE]
  assert prompts.encode_observation(TOK, 1, "err") == [TS, ord("e"), ord("r"), ord("r"), NL, VS, IMG, VE]
  assert prompts.encode_observation(TOK, 0, after_reply=True) == [TE, TS, VS, VE]
  assert prompts.encode_observation(TOK, 1, assistant_prefix=">") == [TS, VS, IMG, VE, ord(">")]
  assert prompts.encode_episode_prefix(TOK, "é", "") == [BOS, 0xC3, 0xA9, NL]  # UTF-8 bytes
  with pytest.raises(ValueError):
    prompts.encode_observation(TOK, -1)


def test_chat_template_episode_by_hand():
  t = prompts.ChatTemplate(TOK, system="S", n_img_tokens=2)
  ids, mask = t.episode("go", [(None, "ok"), ("bad", [ord("x"), EOS])])
  want = ([BOS, ord("S"), 10, ord("g"), ord("o"), 10]       # prefix
          + [TS, VS, IMG, IMG, VE]                           # observation 1
          + [ord("o"), ord("k"), EOS]                        # reply 1 (model)
          + [TE, TS, ord("b"), ord("a"), ord("d"), 10, VS, IMG, IMG, VE]  # observation 2 (error text)
          + [ord("x"), EOS])                                 # reply 2 (model)
  assert ids == want
  assert mask == [0] * 6 + [0] * 5 + [1, 1, 1] + [0] * 10 + [1, 1]
  assert TOK.render(ids) == ("<bos>S\ngo\n<turn><vision_start><image><image><vision_end>ok<eos>"
                             "</turn><turn>bad\n<vision_start><image><image><vision_end>x<eos>")
  with pytest.raises(ValueError):
    t.reply([ord("x")])  # no EOS
  with pytest.raises(ValueError):
    t.reply([IMG, EOS])  # a special id inside the reply


def test_chat_template_matches_trajectory_token_view():
  """The agent loop's layout (trajectory.episode_arrays) equals the template's, tokens and masks."""
  t = prompts.ChatTemplate.for_actions(("click",), n_img_tokens=3, compact=True)
  turns = [(None, "Thought: a\nAction: click(start_box='(1,2)')"), ("invalid action: x", "Thought: \nAction: wait()")]
  ids, mask = t.episode("Click OK", turns)
  ep = Episode(task="t", seed=0, instruction="Click OK", prefix_ids=t.prefix("Click OK"))
  for k, (obs_text, reply) in enumerate(turns):
    r = t.reply(reply)
    ep.turns.append(Turn(image=np.zeros((2, 2, 3), np.uint8), obs_ids=t.observation(obs_text, k > 0),
                         reply_ids=r, logprobs=np.zeros(len(r), np.float32), states=np.zeros(len(r), np.int32)))
  arr = episode_arrays(ep)
  assert arr["tokens"].tolist() == ids and arr["loss"].tolist() == mask
  assert ep.token_ids() == ids
  # the model-written tokens are exactly the replies and their EOS
  assert TOK.decode([i for i, m in zip(ids, mask) if m]) == "".join(r for _, r in turns)
  assert [i for i, m in zip(ids, mask) if m].count(EOS) == 2


def test_system_prompt():
  assert prompts.system_prompt(("click",), compact=True) == "GUI agent. Actions: click."
  assert prompts.system_prompt(compact=True) == "GUI agent. Actions: " + ",".join(ALL_ACTIONS) + "."
  assert prompts.SYSTEM_PROMPT == prompts.system_prompt(ALL_ACTIONS)
  assert len(prompts.SYSTEM_PROMPT.encode()) < 512  # tiny models pay per byte
  only = prompts.system_prompt(("click", "wait"))
  assert "click(start_box='(x,y)')" in only and "wait()" in only and "drag" not in only and "0-1000" in only
  assert "000-999" in prompts.system_prompt(("click",), coord_format="fixed3")
  assert "0-1000" not in prompts.system_prompt(("wait",))  # no coordinates, no coordinate line
  assert "SDK functions" not in prompts.SYSTEM_PROMPT  # the GUI prompt stays GUI-only
  sdk = prompts.system_prompt(("click", "run_command"))
  assert "run_command(command='ls -l')" in sdk and sdk.endswith("not on the screen.")
  with pytest.raises(ValueError):
    prompts.system_prompt(("fly",))
  with pytest.raises(ValueError):
    prompts.system_prompt(coord_format="float")


@pytest.mark.parametrize("fmt,xy", [("int", ("500", "7")), ("fixed3", ("500", "007"))])
def test_system_prompt_examples_are_in_the_grammar(fmt, xy):
  """Every action line the prompt shows, with numbers filled in, is a reply the decoder can write."""
  g = build_grammar(actions=ALL_ACTIONS + SDK_ACTIONS, coord_format=fmt)
  classes = {**CLASSES, **SDK_CLASSES}
  assert set(prompts.ACTION_SIGNATURES) == set(ALL_ACTIONS + SDK_ACTIONS)
  full = prompts.system_prompt(ALL_ACTIONS + SDK_ACTIONS).splitlines()
  for name, sig in prompts.ACTION_SIGNATURES.items():
    assert sig in full and (sig in prompts.SYSTEM_PROMPT.splitlines()) == (name in ALL_ACTIONS)
    line = (sig.replace("(x,y)", f"({xy[0]},{xy[1]})").replace("(x1,y1)", f"({xy[0]},{xy[1]})")
            .replace("(x2,y2)", f"({xy[1]},{xy[0]})"))
    reply = "Thought: \nAction: " + line
    assert accepts(g, reply), reply
    assert isinstance(A.parse_response(reply, sdk=True)[1], classes[name])
