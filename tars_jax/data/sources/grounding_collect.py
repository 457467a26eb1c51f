"""Collection of grounding and perception data for `experiments/grounding.py`: sandbox pages ->
examples -> record sets.

See experiments/grounding.py for the command line and tars_jax/data/sources/grounding.py for the examples.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from typing import Callable

from tqdm import tqdm

from envs_bridge.launch import env_fleet
from tars_jax.data import records
from tars_jax.data.sources import grounding as G
from tars_jax.train import state as state_lib

SOURCE = "grounding"
HELDOUT_SHIFT = 1_000_000  # held-out pages: data.grounding_seed_offset + this + k


def open_record_writer(directory: str, fmt: G.EpisodeFormat):
  """The one place that knows the record format (`tars_jax.data.records`): a RecordWriter of
  `directory` whose meta is the policy's image size and image slots. Returns an object with
  `write(example)` and `close() -> dict`."""
  meta = records.DatasetMeta.for_model(fmt.image_hw, fmt.n_img_tokens, fmt.tokenizer)
  writer = records.RecordWriter(directory, meta)

  class _Sink:
    def write(self, ex: G.Example) -> None:
      writer.write(ex.episode, source=SOURCE, extra=ex.extra())

    def close(self) -> dict:
      return writer.close()
  return _Sink()


class CountingSink:
  """A sink that only counts (--dry_run), or keeps the examples (`keep=True`, tests)."""

  def __init__(self, keep: bool = False):
    self.examples: list[G.Example] = []
    self.keep, self.n = keep, 0

  def write(self, ex: G.Example) -> None:
    self.n += 1
    if self.keep:
      self.examples.append(ex)

  def close(self) -> dict:
    return {"examples": self.n}


def grounding_config(config, kinds):
  """A copy of `config` whose grammar has the actions the kinds reply with (click, finished)."""
  config = config.copy_and_resolve_references()
  need = [a for k, a in (("where", "click"), ("what", "finished")) if k in kinds]
  missing = [a for a in need if a not in tuple(config.grammar.actions)]
  if missing and config.grammar.constrained:
    logging.warning("grammar actions %s lack %s for the %s examples: added (the system prompt lists them "
                    "too; train the policy with this grammar)", tuple(config.grammar.actions), missing, kinds)
    with config.unlocked():
      config.grammar.actions = tuple(config.grammar.actions) + tuple(missing)
  return config


def collect_split(loop, clients, jobs, fmt: G.EpisodeFormat, sink, *, kinds, concurrency: int, chunk: int,
                  max_where_chars: int, desc: str) -> dict:
  """Collects the pages of `jobs`, `chunk` at a time, and writes their examples to `sink`; returns
  {'counts': {task: {kind: n}}, 'pages': n, 'lost': n, 'lost_jobs': [...], 'skipped': {reason: n},
  'pages_without_examples': {task: n}, 'seconds': s}."""
  counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  skipped, empty = collections.Counter(), collections.Counter()
  stats = G.CollectStats()
  t0 = time.perf_counter()
  with tqdm(total=len(jobs), desc=desc, unit="page") as bar:
    for s in range(0, len(jobs), chunk):
      pages = loop.run_until_complete(G.collect_pages(clients, jobs[s:s + chunk], concurrency=concurrency,
                                                      stats=stats, on_page=lambda _: bar.update()))
      for page in pages:
        exs = G.page_examples(fmt, page, kinds=kinds, max_where_chars=max_where_chars, skipped=skipped)
        if not exs:
          empty[page.task] += 1
        for ex in exs:
          sink.write(ex)
          counts[page.task][ex.target.kind] += 1
  return {"counts": {t: {k: counts[t][k] for k in kinds} for t in sorted({t for t, _ in jobs})},
          "pages": stats.pages, "lost": stats.lost, "lost_jobs": stats.lost_jobs, "skipped": dict(skipped),
          "pages_without_examples": dict(empty), "seconds": round(time.perf_counter() - t0, 1)}


def run(config, out: str, tasks, seeds: int, heldout_seeds: int, heldout_offset: int | None = None,
        heldout_tasks=(), kinds=G.KINDS, servers=(), concurrency: int = 8, chunk: int = 256,
        max_where_chars: int = 40,
        sink_factory: Callable[[str, G.EpisodeFormat], object] = open_record_writer) -> dict:
  """Collects both sets and writes them (`sink_factory(directory, fmt)` per set: records by default);
  writes and returns the summary of <out>/grounding.json.

  Raises: ValueError for overlapping seed ranges or unknown kinds; sandbox errors no retry fixes
  (UnknownTask for a misspelt task, ...).
  """
  bad = sorted(set(kinds) - set(G.KINDS))
  if bad:
    raise ValueError(f"unknown kinds {bad}; expected a subset of {G.KINDS}")
  config = grounding_config(config, kinds)
  parts = state_lib.build(config)
  fmt = G.EpisodeFormat.from_parts(parts)
  d = config.data
  heldout_offset = d.grounding_seed_offset + HELDOUT_SHIFT if heldout_offset is None else heldout_offset
  train_jobs, held_jobs = G.split_jobs(tasks, seeds, heldout_seeds, heldout_offset,
                                       train_offset=d.grounding_seed_offset, heldout_tasks=heldout_tasks)
  os.makedirs(out, exist_ok=True)
  summary = {"format": {"system": fmt.system, "image_hw": list(fmt.image_hw), "n_img_tokens": fmt.n_img_tokens,
                        "grammar_actions": list(config.grammar.actions), "coord_format": fmt.coord_format,
                        "max_content_bytes": fmt.max_content_bytes, "kinds": list(kinds)},
             "seeds": {"train": [d.grounding_seed_offset, seeds], "heldout": [heldout_offset, heldout_seeds]}}
  with env_fleet(config.env, urls=list(servers)) as (loop, clients):
    for name, jobs in (("train", train_jobs), ("heldout", held_jobs)):
      sink = sink_factory(os.path.join(out, name), fmt)
      try:
        res = collect_split(loop, clients, jobs, fmt, sink, kinds=kinds, concurrency=concurrency, chunk=chunk,
                            max_where_chars=max_where_chars, desc=name)
      finally:
        written = sink.close()  # also when collecting failed: the shards written so far stay readable
      summary[name] = {**res, "writer": written}
  with open(os.path.join(out, "grounding.json"), "w") as f:
    json.dump(summary, f, indent=2, default=str)
  return summary


def format_counts(split: dict) -> str:
  """A table of examples per task and kind of one split's summary."""
  counts = split["counts"]
  kinds = sorted({k for c in counts.values() for k in c}, key=lambda k: G.KINDS.index(k))
  lines = [f"{'task':32s}" + "".join(f"{k:>8s}" for k in kinds)]
  for task, c in counts.items():
    lines.append(f"{task:32s}" + "".join(f"{c[k]:8d}" for k in kinds))
  lines.append(f"{'total':32s}" + "".join(f"{sum(c[k] for c in counts.values()):8d}" for k in kinds))
  return "\n".join(lines)
