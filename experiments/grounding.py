r"""Grounding and perception data from sandbox pages: "where is X" -> click, "what is at (x,y)" -> text.

The stage that gives a base model its eyes before any task data (UI-TARS-2 report, section 2.3;
issue #25): the first page of each MiniWoB++ task and seed, its visible DOM elements read through the
sandbox's debug `elements` call, turned into one-turn episodes in the policy's own format
(`tars_jax/data/sources/grounding.py`), written as train and held-out record sets:

  python -m experiments.grounding --config experiments/configs/miniwob_ppo.py --out data/grounding \
      --seeds 50 --heldout_seeds 10 [--tasks miniwob/click-button,...] [--heldout_tasks ...]
  python -m experiments.grounding --config experiments/configs/miniwob_ppo.py --out /tmp/g --dry_run

The config gives the image size, image slots, system prompt and grammar (coordinate grid, content
cap). 'what' replies are `finished(content=...)`: when the config's grammar lacks 'finished' it is
added (with a warning: the system prompt then lists it too, so train the policy with that grammar).
Train seeds are data.grounding_seed_offset + [0, seeds); held-out seeds --heldout_offset (default
data.grounding_seed_offset + 1e6) + [0, heldout_seeds), disjoint from them and from evaluation seeds; --heldout_tasks appear only in the
held-out set. Writes <out>/train and <out>/heldout (records), and <out>/grounding.json (format,
counts per task and kind, skip reasons, timing).
"""

from __future__ import annotations

import logging
import os

from absl import app, flags
from ml_collections import config_flags

from tars_jax.data.sources import grounding as G
from tars_jax.data.sources.grounding_collect import CountingSink, format_counts, open_record_writer, run

_CONFIG = config_flags.DEFINE_config_file("config", None, "Policy config (image size, grammar, prompt).")
_OUT = flags.DEFINE_string("out", None, "Output directory (train/, heldout/, grounding.json).")
_TASKS = flags.DEFINE_list("tasks", None, "Tasks of both sets (default: the config's data.grounding_tasks, "
                           "or DEFAULT_TASKS when that is empty).")
_SEEDS = flags.DEFINE_integer("seeds", None, "Train seeds (pages) per task (default: data.grounding_seeds).")
_HELDOUT_SEEDS = flags.DEFINE_integer("heldout_seeds", None, "Held-out seeds per task (default: "
                                      "data.grounding_heldout_seeds).")
_HELDOUT_OFFSET = flags.DEFINE_integer("heldout_offset", None, "First held-out seed (default: the "
                                       "config's data.grounding_seed_offset + 1e6).")
_HELDOUT_TASKS = flags.DEFINE_list("heldout_tasks", [], "Tasks only in the held-out set.")
_KINDS = flags.DEFINE_list("kinds", list(G.KINDS), "Example kinds: where, what.")
_SERVERS = flags.DEFINE_list("servers", [], "Sandbox server URLs (default: launch one).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 8, "Pages opened at a time.")
_CHUNK = flags.DEFINE_integer("chunk", 256, "Pages collected before their examples are written.")
_MAX_WHERE_CHARS = flags.DEFINE_integer("max_where_chars", 40, "Longest name asked for in 'where'.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Collect and count, write only grounding.json.")


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.WARNING)  # no per-request httpx lines under the progress bar
  sink_factory = (lambda d, f: CountingSink()) if _DRY_RUN.value else open_record_writer
  d = _CONFIG.value.data
  tasks = _TASKS.value or list(d.grounding_tasks) or list(G.DEFAULT_TASKS)
  seeds = d.grounding_seeds if _SEEDS.value is None else _SEEDS.value
  heldout_seeds = d.grounding_heldout_seeds if _HELDOUT_SEEDS.value is None else _HELDOUT_SEEDS.value
  summary = run(_CONFIG.value, _OUT.value, tasks, seeds, heldout_seeds,
                _HELDOUT_OFFSET.value, _HELDOUT_TASKS.value, tuple(_KINDS.value), _SERVERS.value,
                _CONCURRENCY.value, _CHUNK.value, _MAX_WHERE_CHARS.value, sink_factory=sink_factory)
  for name in ("train", "heldout"):
    s = summary[name]
    print(f"[{name}] {s['pages']} pages in {s['seconds']} s, {s['lost']} lost; skipped: {s['skipped']}")
    if s["pages_without_examples"]:
      print(f"[{name}] pages without examples: {s['pages_without_examples']}")
    print(format_counts(s))
  print(f"[grounding] wrote {os.path.join(_OUT.value, 'grounding.json')}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "out"])
  app.run(main)
