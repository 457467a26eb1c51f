r"""The inference service's decode step over the attended span vs over the whole KV cache, side by side.

  .venv/bin/python -m benchmarks.service_step [--config experiments/configs/replication_multiturn.py:ppo] \
      [--slots 32] [--lengths 1280,3776] [--spans 256,1024,all] [--cursor 150] [--repeats 20]

`InferenceService` sizes each slot's cache for the longest episode it may serve (`Parts.context_capacity`:
3 776 positions for the multi-turn suite's 6 turns) and a decode step streams every slot's keys and
values; `slot_decode.step(span=)` attends over (and writes into) the first `span` positions only, the
256 * 2**k that hold every context the service keeps (`InferenceService._span`). For each cache length
and span ("all" = the whole cache, the step before spans), the config's model (random init: weights do
not change the time) decodes one jump-forward chunk in all `slots` slots, every slot active at cache
position `cursor`; after 3 untimed steps (compilation), `repeats` rounds of one timed step of every
column in turn (`bench_model.interleaved_medians`). Prints ms per step and the ratio to "all" of the
same length.
"""

from __future__ import annotations

from absl import app, flags
import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import config_flags

from benchmarks.bench_model import interleaved_medians
from benchmarks.command import command_line
from tars_jax.models.inference import slot_decode
from tars_jax.train import state as state_lib

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/replication_multiturn.py:ppo",
                                          "Config whose model and grammar are timed.")
_SLOTS = flags.DEFINE_integer("slots", 32, "KV-cache slots (the suite's env.num_sessions).")
_LENGTHS = flags.DEFINE_list("lengths", ["1280", "3776"], "Cache positions per slot (context_len).")
_SPANS = flags.DEFINE_list("spans", ["256", "1024", "all"], "Attended spans; 'all' = the whole cache.")
_CURSOR = flags.DEFINE_integer("cursor", 150, "Cache position of every slot's next token.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed rounds.")


def main(argv):
  del argv
  config = _CONFIG.value
  parts = state_lib.build(config)
  gd, params = parts.policy_gd, parts.init_state(0)["policy"]
  model = nnx.merge(gd, params)
  weights = slot_decode.prepare_decode_weights(gd, params)
  table = jnp.asarray(parts.grammar.table)
  n, chunk = _SLOTS.value, int(config.sampling.jump_forward)
  kw = dict(temperature=1.0, top_p=1.0, eos_id=parts.tokenizer.eos_id, pad_id=parts.tokenizer.pad_id, chunk=chunk)

  def reset(slots):  # every slot active at the same cursor again: each timed step does the same work
    return slots._replace(cur=jnp.full((n,), _CURSOR.value, jnp.int32), active=jnp.ones((n,), bool),
                          left=jnp.full((n,), 1 << 30, jnp.int32),
                          state=jnp.full((n,), parts.grammar.start, jnp.int32))

  state, fns = {}, {}
  for length in map(int, _LENGTHS.value):
    for span in _SPANS.value:
      s = None if span == "all" else int(span)
      if s is not None and (s > length or s < _CURSOR.value + chunk):
        continue
      name = (length, span)
      state[name] = reset(slot_decode.init_slots(model, n, length))

      def one(name=name, s=s):
        slots, out = slot_decode.step(gd, params, weights, state[name], table, span=s, **kw)
        state[name] = reset(slots)
        return jax.block_until_ready(out.tokens)
      fns[name] = one
  _, med = interleaved_medians(fns, warmup=3, repeats=_REPEATS.value)
  print(command_line("benchmarks.service_step", f"--slots {n} --lengths {','.join(_LENGTHS.value)} --spans "
                     f"{','.join(_SPANS.value)} --cursor {_CURSOR.value} --repeats {_REPEATS.value}"))
  print(f"{n} slots, chunk {chunk}, every slot at position {_CURSOR.value}; median of {_REPEATS.value}")
  print("| cache length | span | ms per step | x whole cache |")
  print("|---|---|---|---|")
  for (length, span), t in med.items():
    base = med.get((length, "all"))
    ratio = f"{base / t:.2f}x" if base else "-"
    print(f"| {length} | {span} | {t * 1000:.1f} | {ratio} |")


if __name__ == "__main__":
  app.run(main)
