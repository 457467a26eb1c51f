"""Batched policy inference for rollouts (in-process; an async server is a later issue).

Turns a list of prompts (token ids + the screenshots of their turns) into one left-padded batch of
fixed shape, runs the KV-cache sampler with grammar-constrained decoding, and splits the replies.
Shapes are bucketed (batch to `batch_size`, prompt length to a multiple of `length_multiple`) so
jit compiles a handful of programs per run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tars_jax.agent.grammar import Grammar
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import bucket
from tars_jax.models import sampler


def max_reply_tokens(grammar: Grammar) -> int:
  """Longest path (in tokens, EOS included) from `grammar.start` to `grammar.done`.

  Raises:
    ValueError: the automaton has a reachable cycle (unbounded replies).
  """
  table, done = grammar.table, grammar.done
  # Iterative DFS post-order: longest[s] = 1 + max over successors (done counts 0).
  longest: dict[int, int] = {done: 0}
  color: dict[int, int] = {}  # 1 = on stack, 2 = finished
  stack = [(grammar.start, iter(sorted({int(x) for x in table[grammar.start] if x >= 0})))]
  color[grammar.start] = 1
  while stack:
    s, it = stack[-1]
    nxt = next(it, None)
    if nxt is None:
      stack.pop()
      color[s] = 2
      longest[s] = 1 + max((longest[n] for n in {int(x) for x in table[s] if x >= 0}), default=-1)
      continue
    if nxt == done or color.get(nxt) == 2:
      continue
    if color.get(nxt) == 1:
      raise ValueError("grammar has a cycle; replies are unbounded")
    color[nxt] = 1
    stack.append((nxt, iter(sorted({int(x) for x in table[nxt] if x >= 0}))))
  return longest[grammar.start]


@dataclasses.dataclass
class BatchedPolicy:
  """Samples replies for many prompts at once with the current policy parameters.

  Attributes:
    graphdef, params: the NNX policy split (`nnx.split`); replace `params` after each update.
    grammar: constrained-decoding automaton, or None for free text.
    max_images: image slots per row (= max turns of an episode).
    seed: sampling keys derive from (seed, iteration, call): `start_iteration(it)` sets the key to
      fold_in(PRNGKey(seed), it) and each batch of `act` splits it, so an iteration's samples depend
      only on the seed, the iteration and the calls made in it, never on when the process started
      (a run resumed at iteration `it` draws what an uninterrupted run draws there).
  """

  graphdef: object
  params: object
  tokenizer: ByteTokenizer
  grammar: Grammar | None
  batch_size: int
  max_images: int
  image_hw: tuple[int, int]
  max_new_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  length_multiple: int = 64
  seed: int = 0
  jump_forward: int = 1  # tokens per decode step incl. grammar-forced ones (`sampler.generate`)

  def __post_init__(self):
    self._table = None if self.grammar is None else jnp.asarray(self.grammar.table)
    self.start_iteration(0)

  def start_iteration(self, iteration: int) -> None:
    """Resets the sampling key to fold_in(PRNGKey(seed), iteration); call at the start of each
    training iteration."""
    self._key = jax.random.fold_in(jax.random.PRNGKey(self.seed), int(iteration))

  def act(self, prompts: list[list[int]], images: list[list[np.ndarray]]
          ) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """Replies for each prompt: (ids up to and including EOS, logprobs [n], grammar states [n]).

    `images[i]` are the [H, W, 3] uint8 screenshots of prompt i, in order of their IMAGE blocks.
    """
    out = []
    for s in range(0, len(prompts), self.batch_size):
      out += self._act_chunk(prompts[s:s + self.batch_size], images[s:s + self.batch_size])
    return out

  def _act_chunk(self, prompts, images):
    n, b = len(prompts), self.batch_size
    p = bucket(max(len(x) for x in prompts), self.length_multiple)
    h, w = self.image_hw
    tokens = np.full((b, p), self.tokenizer.pad_id, np.int32)
    mask = np.zeros((b, p), bool)
    pix = np.zeros((b, self.max_images, h, w, 3), np.float32)
    img_mask = np.zeros((b, self.max_images), bool)
    for i in range(b):
      ids = prompts[i] if i < n else [self.tokenizer.bos_id]  # filler rows: one BOS token
      tokens[i, p - len(ids):], mask[i, p - len(ids):] = ids, True  # left padding
      for m, im in enumerate(images[i] if i < n else []):
        pix[i, m] = im.astype(np.float32) / 255.0
        img_mask[i, m] = True
    self._key, key = jax.random.split(self._key)
    start = None if self.grammar is None else jnp.full((b,), self.grammar.start, jnp.int32)
    gen = sampler.generate(
        self.graphdef, self.params, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(pix),
        jnp.asarray(img_mask), key, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
        top_p=self.top_p, grammar_table=self._table, start_state=start, jump_forward=self.jump_forward,
        eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id)
    toks, lps, sts, lens = (np.asarray(x) for x in (gen.tokens, gen.logprobs, gen.states, gen.lengths))
    res = []
    for i in range(n):
      k = int(lens[i])
      st = sts[i, :k] if self.grammar is not None else np.full((k,), -1, np.int32)
      res.append((toks[i, :k].tolist(), lps[i, :k], st))
    return res
