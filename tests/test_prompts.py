from tars_jax.agent import prompts
from tars_jax.agent.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def test_prefix_and_observation_tokens_by_hand():
  assert prompts.encode_episode_prefix(TOK, "Hi", "S") == [257, ord("S"), 10, ord("H"), ord("i"), 10]
  assert prompts.encode_observation(TOK, 3) == [262, 260, 259, 259, 259, 261]
  assert prompts.encode_observation(TOK, 1, "err") == [262, ord("e"), ord("r"), ord("r"), 10, 260, 259, 261]
  assert prompts.system_prompt(("click",), compact=True) == "GUI agent. Actions: click."
  assert TOK.decode(TOK.encode("héllo") + [259]) == "héllo"
