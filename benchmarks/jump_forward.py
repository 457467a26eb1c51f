r"""Generation speed of the demo policy with and without jump-forward decoding, side by side.

  .venv/bin/python -m benchmarks.jump_forward [--batch 32] [--repeats 5]

Builds the main job's model and grammar (experiments/configs/miniwob_ppo.py, random init), makes a
batch of prompts shaped like a first turn (prefix + one screenshot), and times
`sampler.generate` (compiled first) for jump_forward K = 1, 8, 40 at the same key. Prints a table
with replies/s and the speed-up over K = 1; the outputs are checked to be identical under greedy
decoding, so the table compares equal work.
"""

from __future__ import annotations

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.configs import miniwob_ppo
from tars_jax.agent import prompts
from tars_jax.models.inference import sampler
from tars_jax.train import state as state_lib

_BATCH = flags.DEFINE_integer("batch", 32, "Rows per generate call (the demo's num_sessions).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per setting.")


def main(argv):
  del argv
  cfg = miniwob_ppo.get_config()
  parts = state_lib.build(cfg)
  st = parts.init_state(0)
  tok, b = parts.tokenizer, _BATCH.value
  n_img = parts.model_cfg.n_img_tokens
  prefix = prompts.encode_episode_prefix(tok, "Click the button.", parts.loop_cfg.system)
  ids = prefix + [tok.vision_start_id] + [tok.image_id] * n_img + [tok.vision_end_id]
  p = len(ids)
  toks = jnp.asarray(np.tile(np.asarray(ids, np.int32), (b, 1)))
  mask = jnp.ones((b, p), bool)
  h, w = parts.image_hw
  pix = jnp.asarray(np.random.default_rng(0).random((b, 1, h, w, 3), np.float32))
  kw = dict(max_new_tokens=parts.max_new_tokens, grammar_table=parts.table,
            start_state=jnp.full((b,), parts.grammar.start, jnp.int32), eos_id=tok.eos_id, pad_id=tok.pad_id)
  rows, ref = [], None
  for k in (1, 8, 40):
    run = lambda temp, key: sampler.generate(parts.policy_gd, st["policy"], toks, mask, pix, None, key,
                                             temperature=temp, jump_forward=k, **kw)
    greedy = run(0.0, jax.random.PRNGKey(0))
    if ref is None:
      ref = greedy
    np.testing.assert_array_equal(greedy.tokens, ref.tokens)  # same work at every K
    jax.block_until_ready(run(1.0, jax.random.PRNGKey(1)).tokens)  # compile the sampling path
    t0 = time.perf_counter()
    for r in range(_REPEATS.value):
      jax.block_until_ready(run(1.0, jax.random.PRNGKey(2 + r)).tokens)
    dt = (time.perf_counter() - t0) / _REPEATS.value
    rows.append((k, dt, b / dt))
  base = rows[0][1]
  print(f"\nbatch {b}, reply <= {parts.max_new_tokens} tokens, prompt {p} tokens, {jax.devices()[0].platform}")
  print(f"{'jump_forward':>12} {'s/call':>8} {'replies/s':>10} {'speed-up':>9}")
  for k, dt, rps in rows:
    print(f"{k:>12} {dt:>8.3f} {rps:>10.1f} {base / dt:>8.2f}x")


if __name__ == "__main__":
  app.run(main)
