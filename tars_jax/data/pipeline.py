"""The training iterator over trajectory records (grain): per-process share, per-epoch shuffle,
batches of one length bucket, collated.

  episodes(dirs)                                   MapDataset of (Episode, provenance)   records.py
    .filter(not lost)                              lost episodes are never trained on
    [process_index::process_count]                 this process's disjoint share
    .shuffle(seed).repeat(num_epochs)              a new permutation each epoch (grain reseeds per epoch)
    LengthBucketBatchIterDataset                   lists of batch_size episodes of one length bucket
    .map(collate_fn)                               dict of arrays, e.g. trajectory.collate(...).as_dict()

Length buckets: an episode of L tokens (`Episode.token_ids()`) falls in bucket
`trajectory.bucket(L, length_multiple)`, the padded length `trajectory.collate` gives it with the same
`length_multiple`; a batch holds `batch_size` episodes of one bucket, so it is padded to its bucket and
jit sees one shape per bucket. Episodes wait in their bucket until it fills: at most
n_buckets * (batch_size - 1) decoded episodes are held; within a batch the order is the stream's.
Batches never straddle epochs: at the end of each epoch the part-filled buckets come out, shortest
first, as smaller batches (collate pads the rows up to its `batch_size`), or are dropped with
drop_remainder. So each epoch yields every episode of the share exactly once (no duplicate within
a batch), and an epoch has at most n_buckets smaller batches.

`mix` interleaves several such streams by weight (an SFT and a continual-pretraining set, the
trainer experiments/sft.py), as `(name, batch)` pairs, its state holding each stream's.

Resuming: the iterator's `get_state()` is a small JSON-able dict (the stream position and the stream
positions of the waiting episodes); `set_state` on a fresh iterator of the same pipeline re-reads the
waiting episodes and continues with exactly the batches the saved run would have produced.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import grain

from tars_jax.agent.trajectory import Episode, bucket
from tars_jax.data.records import EmptyDataset

STATE_VERSION = 1


def _episode(element) -> Episode:
  return element[0] if isinstance(element, tuple) else element


def _trainable(element) -> bool:
  # A lost episode (the sandbox died mid-episode) is stored for the statistics, never trained on.
  return not _episode(element).lost


def num_tokens(ep: Episode) -> int:
  """Length in tokens of an episode's token view (= len(ep.token_ids()))."""
  return len(ep.prefix_ids) + sum(len(t.obs_ids) + len(t.reply_ids) for t in ep.turns)


class LengthBucketBatchIterDataset(grain.IterDataset):
  """Lists of `batch_size` Episodes of one length bucket, from a MapDataset of Episodes or
  (Episode, provenance) pairs (None elements, e.g. skipped corrupt records, are passed over).

  Custom because grain 0.2 batches in stream order only. Reads through the parent's
  `to_iter_dataset(read_options)` (grain's threaded prefetch); its state is that reader's position
  plus the positions of the episodes waiting in part-filled buckets (see module docstring).
  """

  def __init__(self, parent: grain.MapDataset, *, batch_size: int, length_multiple: int,
               drop_remainder: bool = False, read_options: grain.ReadOptions | None = None,
               epoch_length: int | None = None, fingerprint: dict | None = None):
    super().__init__(parent)
    if batch_size <= 0 or length_multiple <= 0:
      raise ValueError(f"batch_size and length_multiple must be positive, got {batch_size}, {length_multiple}")
    self.batch_size, self.length_multiple, self.drop_remainder = batch_size, length_multiple, drop_remainder
    self.read_options = read_options or grain.ReadOptions(num_threads=4, prefetch_buffer_size=max(16, 2 * batch_size))
    self.epoch_length = epoch_length or len(parent)  # buckets are emptied every epoch_length elements
    # JSON-able description of the pipeline (share size, seed, ...), recorded in the state: a state
    # saved from another pipeline is refused instead of silently giving other batches.
    self.fingerprint = dict(fingerprint or {}, batch_size=batch_size, length_multiple=length_multiple,
                            epoch_length=self.epoch_length)

  def __iter__(self) -> "_LengthBucketBatchIterator":
    return _LengthBucketBatchIterator(self)

  def __str__(self) -> str:
    return f"LengthBucketBatchIterDataset(batch_size={self.batch_size}, length_multiple={self.length_multiple})"


class _LengthBucketBatchIterator(grain.DatasetIterator):

  def __init__(self, ds: LengthBucketBatchIterDataset):
    super().__init__()
    self._ds = ds
    self._map: grain.MapDataset = ds._parent  # pylint: disable=protected-access
    self._len = len(self._map)
    self._reader = iter(self._map.to_iter_dataset(ds.read_options, allow_nones=True))
    self._next = 0  # stream position of the reader's next element
    self._pending: dict[int, list[tuple[int, Episode]]] = {}  # bucket -> [(position, episode)], stream order

  def __next__(self) -> list[Episode]:
    self._assert_not_closed()
    ds = self._ds
    while True:
      if self._pending and self._next and self._next % ds.epoch_length == 0:
        # End of an epoch (or of the stream): empty the part-filled buckets, shortest first.
        if ds.drop_remainder:
          self._pending.clear()
        else:
          return [e for _, e in self._pending.pop(min(self._pending))]
      if self._next >= self._len:
        raise StopIteration
      element = next(self._reader)
      pos, self._next = self._next, self._next + 1
      if element is None:
        continue
      ep = _episode(element)
      b = bucket(num_tokens(ep), ds.length_multiple)
      waiting = self._pending.setdefault(b, [])
      waiting.append((pos, ep))
      if len(waiting) == ds.batch_size:
        del self._pending[b]
        return [e for _, e in waiting]

  def get_state(self) -> dict[str, Any]:
    return {"version": STATE_VERSION, "next_index": self._next, "pipeline": self._ds.fingerprint,
            "pending": [[b, [p for p, _ in self._pending[b]]] for b in sorted(self._pending)]}

  def set_state(self, state: dict[str, Any]) -> None:
    if state.get("version") != STATE_VERSION:
      raise ValueError(f"iterator state version {state.get('version')}, this code reads {STATE_VERSION}")
    saved, here = state["pipeline"], self._ds.fingerprint
    diff = sorted(k for k in set(saved) | set(here) if saved.get(k) != here.get(k))
    if diff:
      raise ValueError("iterator state of another pipeline: " + ", ".join(
          f"{k}={saved.get(k)!r} saved, {here.get(k)!r} here" for k in diff))
    self._next = int(state["next_index"])
    self._reader.set_state({"next_index": self._next})
    self._pending = {}
    for b, positions in state["pending"]:
      self._pending[int(b)] = [(int(p), _episode(self._map[int(p)])) for p in positions]

  def close(self) -> None:
    if not self._closed:
      self._reader.close()
    super().close()

  def __str__(self) -> str:
    return f"_LengthBucketBatchIterator({self._ds})"


def batches(ds: grain.MapDataset, *, seed: int, batch_size: int, collate_fn: Callable[[list[Episode]], Any],
            shuffle: bool = True, num_epochs: int | None = None, process_index: int = 0, process_count: int = 1,
            length_multiple: int = 64, drop_remainder: bool = False,
            read_options: grain.ReadOptions | None = None) -> grain.IterDataset:
  """Training batches from `records.episodes(...)` (or any MapDataset of Episodes / (Episode, x) pairs),
  lost episodes left out (pipeline in the module docstring).

  Args:
    seed: shuffle seed in [0, 2**32); epoch e uses permutation seed + e (grain ShuffleMapDataset).
    batch_size: episodes per batch (fewer only in the remainder batches at the end of an epoch).
    collate_fn: list of Episodes -> batch, e.g. `lambda eps: trajectory.collate(eps, pad_id=...,
      max_images=..., image_hw=..., length_multiple=length_multiple, batch_size=batch_size).as_dict()`.
    num_epochs: None repeats forever.
    process_index, process_count: this process takes elements process_index, process_index +
      process_count, ... of the dataset: disjoint shares that together cover it.
    length_multiple: bucket width in tokens (module docstring); pass the same to collate.
    read_options: grain threads / prefetch depth of the reads and decodes (default 4 threads,
      max(16, 2 * batch_size) episodes ahead).
  Returns: an IterDataset; its iterator's get_state() / set_state() resume exactly (JSON-able state,
    one per process; set_state raises ValueError for a state saved from a pipeline of other
    arguments or dataset size).
  Raises: ValueError for bad arguments; EmptyDataset when this process's share is empty.
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
  if num_epochs is not None and num_epochs <= 0:
    raise ValueError(f"num_epochs must be positive or None, got {num_epochs}")
  share = ds.filter(_trainable)[process_index::process_count]
  if len(share) == 0:
    raise EmptyDataset(f"process {process_index} of {process_count} gets no episodes of a dataset of {len(ds)}")
  epoch_length = len(share)
  fingerprint = dict(seed=seed if shuffle else None, num_epochs=num_epochs,
                     process_index=process_index, process_count=process_count, drop_remainder=drop_remainder)
  if shuffle:
    share = share.shuffle(seed)
  share = share.repeat(num_epochs)
  return LengthBucketBatchIterDataset(share, batch_size=batch_size, length_multiple=length_multiple,
                                      drop_remainder=drop_remainder, read_options=read_options,
                                      epoch_length=epoch_length, fingerprint=fingerprint).map(collate_fn)


MIX_STATE_VERSION = 1


def _tag(name: str, element) -> tuple[str, Any]:
  return name, element


class _MixIterDataset(grain.IterDataset):
  """grain's `IterDataset.mix` of named sources whose iterator state also records the weights (a
  state saved with other weights is refused: the same position would name other batches)."""

  def __init__(self, parent: grain.IterDataset, weights: dict[str, float]):
    super().__init__(parent)
    self.weights = weights

  def __iter__(self) -> "_MixIterator":
    return _MixIterator(self._parent.__iter__(), self.weights)

  def __str__(self) -> str:
    return f"MixIterDataset(weights={self.weights})"


class _MixIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, weights: dict[str, float]):
    super().__init__(parent)
    self._weights = weights

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return {"mix_version": MIX_STATE_VERSION, "weights": dict(self._weights), "mix": self._parent.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    if "mix_version" not in state:
      raise ValueError(f"iterator state of an unmixed stream, this pipeline mixes {self._weights}")
    if state["mix_version"] != MIX_STATE_VERSION:
      raise ValueError(f"mix state version {state['mix_version']}, this code reads {MIX_STATE_VERSION}")
    if state["weights"] != self._weights:
      raise ValueError(f"iterator state of another mix: weights {state['weights']} saved, {self._weights} here")
    self._parent.set_state(state["mix"])


def mix(sources: dict[str, grain.IterDataset], weights: dict[str, float]) -> grain.IterDataset:
  """`(name, element)` pairs drawn from named endless sources (e.g. `batches(...)` of an SFT and a CT
  set) in proportion to `weights`; sources of weight 0 are left out.

  The draw is grain's `IterDataset.mix`: a fixed, evenly spread interleaving, not a random one (weights
  0.75 / 0.25: every fourth element from the second source), so any window of n elements holds each
  source's share up to about one element (grain scales the weights to integers, the smallest to 100:
  a share is met to within 1% of itself).
  Resuming: the iterator's state is {"mix_version", "weights", "mix": grain's state (the mix position and
  each source's own state, by name)}; set_state raises ValueError for a state of other weights. With a
  single source left, its own dataset is returned, tagged (its state is that source's, as before any
  mixing: checkpoints of unmixed runs resume).

  Raises: ValueError for weights < 0, all 0, or names that differ from the sources'.
  """
  if set(sources) != set(weights):
    raise ValueError(f"sources {sorted(sources)} and weights {sorted(weights)} name different datasets")
  if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
    raise ValueError(f"mix weights must be >= 0 and not all 0, got {weights}")
  tagged = {k: sources[k].map(functools.partial(_tag, k)) for k, w in weights.items() if w > 0}
  if len(tagged) == 1:
    return next(iter(tagged.values()))
  kept = {k: float(weights[k]) for k in tagged}
  return _MixIterDataset(grain.IterDataset.mix(tagged, kept), kept)
