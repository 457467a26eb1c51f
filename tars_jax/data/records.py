"""Trajectory records: episodes (demonstrations, grounding examples, rollouts) in ArrayRecord shards.

A dataset is a directory:

  <dir>/dataset.json                      index: DatasetMeta, shard list, episode counts
  <dir>/<prefix>-NNNNN.array_record       shards, one record per episode (group_size:1, zstd)

Several `RecordWriter`s may write into one directory (e.g. one per PPO iteration, prefix
`iter_00012`); each adds its shards to `dataset.json` when it closes, under a file lock, so the
directory reads as one dataset. `dataset.json` is the commit point: shards it does not list (a
writer killed before `close`) are never read, and a rerun of that writer overwrites them.

Record format, version 1 (`FORMAT_VERSION`): one msgpack map per episode (msgpack: the format
flax.serialization uses; no pickle, so records are readable without this code and safe to load).
Arrays are raw little-endian bytes of a fixed dtype: ids `<i4`, floats `<f4`.

  v              int     1
  task, seed, instruction, truncated, lost, policy_version      Episode fields
  prefix_ids     <i4     episode prefix (BOS, system, instruction)
  turns          list of maps, one per Turn:
    image_png    bytes   Turn.image, uint8 [H, W, 3] = DatasetMeta.image_hw, lossless PNG (RGB)
    obs_ids, reply_ids, states  <i4;   logprobs <f4 (behaviour policy)
    text, reward, env_reward, done, error (str | nil), info (map)
  flat           map     `trajectory.episode_arrays` (input alignment, [L] each): tokens <i4,
                         loss <f4 (the loss mask), reward <f4, logp <f4, state <i4. Redundant with the
                         turns; kept for readers without this code, and checked on decode.
  provenance     map     source ('expert' | 'grounding' | 'rollout' | ...), task, seed,
                         policy_version, created (unix seconds), extra (free map)

msgpack turns tuples into lists, and numpy scalars / arrays in `info` / `extra` into numbers / lists.

Reading goes through grain (`episodes` -> `grain.MapDataset`, decoded lazily; `pipeline.batches`
for the training iterator, re-exported here).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import fcntl
import io
import json
import logging
import os
import re
import threading
import time
from typing import Sequence

import grain
import msgpack
import numpy as np
from array_record.python import array_record_module
from PIL import Image

from tars_jax.agent import tokenizer as tokenizer_lib
from tars_jax.agent.trajectory import Episode, Turn, episode_arrays

FORMAT_VERSION = 1  # of one record (module docstring)
INDEX_VERSION = 1  # of dataset.json
INDEX_FILE = "dataset.json"
SHARD_SUFFIX = ".array_record"
# group_size:1 = one record per Riegeli chunk: O(1) random access for grain, and a damaged chunk
# (its hash no longer matches) costs one episode, not a group.
WRITER_OPTIONS = "group_size:1"
PNG_COMPRESS_LEVEL = 1  # vs 6 on 224x168 UI screenshots: ~15% larger, about half the encode time

_I4, _F4 = np.dtype("<i4"), np.dtype("<f4")


class DatasetMismatch(ValueError):
  """A dataset's DatasetMeta differs from the model's (or from another dataset's)."""


class EmptyDataset(ValueError):
  """The dataset directories hold no records."""


class CorruptRecord(ValueError):
  """A record that cannot be read or decoded. `file` is the shard path, `index` the record's position
  in it."""

  def __init__(self, file: str, index: int, cause: str):
    super().__init__(f"corrupt record {index} of {file}: {cause}")
    self.file, self.index, self.cause = file, index, cause

  def __reduce__(self):  # picklable (grain worker processes send exceptions back)
    return CorruptRecord, (self.file, self.index, self.cause)


@dataclasses.dataclass(frozen=True)
class DatasetMeta:
  """What the records were made for; stored in dataset.json and checked against the model.

  image_hw: (H, W) pixels of the stored screenshots (= the policy's input size).
  n_img_tokens: IMAGE slots per screenshot in obs_ids.
  tokenizer: name of the tokenizer ("byte" = `agent.tokenizer.ByteTokenizer`); vocab_size its size.
  """

  image_hw: tuple[int, int]
  n_img_tokens: int
  tokenizer: str
  vocab_size: int

  def __post_init__(self):
    hw = tuple(int(x) for x in self.image_hw)
    if len(hw) != 2 or min(hw) <= 0:
      raise ValueError(f"image_hw must be two positive ints (H, W), got {self.image_hw!r}")
    object.__setattr__(self, "image_hw", hw)
    if self.n_img_tokens < 0 or self.vocab_size <= 0 or not self.tokenizer:
      raise ValueError(f"bad DatasetMeta {self}")

  def to_json(self) -> dict:
    return dict(image_hw=list(self.image_hw), n_img_tokens=self.n_img_tokens, tokenizer=self.tokenizer,
                vocab_size=self.vocab_size)

  @classmethod
  def for_model(cls, image_hw: tuple[int, int], n_img_tokens: int, tokenizer) -> "DatasetMeta":
    """The meta of records a policy with this input size, image slots and tokenizer (an object with
    `name` and `vocab_size`, e.g. `agent.tokenizer.ByteTokenizer`) writes and reads."""
    return cls(image_hw=tuple(image_hw), n_img_tokens=n_img_tokens, tokenizer=tokenizer.name,
               vocab_size=tokenizer.vocab_size)

  @classmethod
  def from_json(cls, d: dict) -> "DatasetMeta":
    return cls(image_hw=tuple(d["image_hw"]), n_img_tokens=int(d["n_img_tokens"]), tokenizer=str(d["tokenizer"]),
               vocab_size=int(d["vocab_size"]))


def _diff(a: DatasetMeta, b: DatasetMeta) -> list[str]:
  return [f.name for f in dataclasses.fields(DatasetMeta) if getattr(a, f.name) != getattr(b, f.name)]


def check_compatible(meta: DatasetMeta, *, image_hw: tuple[int, int], n_img_tokens: int, tokenizer: str,
                     vocab_size: int) -> None:
  """Checks that a dataset fits the model it is about to train.

  Raises:
    DatasetMismatch: naming the first differing field, the dataset's value and the model's.
  """
  model = DatasetMeta(image_hw=image_hw, n_img_tokens=n_img_tokens, tokenizer=tokenizer, vocab_size=vocab_size)
  for name in _diff(meta, model):
    raise DatasetMismatch(f"dataset {name}={getattr(meta, name)!r} but the model has {name}={getattr(model, name)!r}")


# ---------------------------------------------------------------------------------------------- record format

def _arr(x, dtype) -> bytes:
  return np.asarray(x).astype(dtype, copy=False).tobytes()


def _ids(b: bytes) -> list[int]:
  return np.frombuffer(b, _I4).tolist()


def _plain(obj):
  """msgpack `default`: numpy values -> Python numbers / lists."""
  if isinstance(obj, np.generic):
    return obj.item()
  if isinstance(obj, np.ndarray):
    return obj.tolist()
  raise TypeError(f"cannot store {type(obj).__name__} in a record (info / extra must be msgpack-able)")


def encode_png(image: np.ndarray) -> bytes:
  """uint8 [H, W, 3] -> PNG bytes (lossless)."""
  buf = io.BytesIO()
  Image.fromarray(image, "RGB").save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
  return buf.getvalue()


def decode_png(data: bytes) -> np.ndarray:
  """PNG bytes -> uint8 [H, W, 3]."""
  with Image.open(io.BytesIO(data)) as im:
    return np.asarray(im.convert("RGB"))


def encode_episode(ep: Episode, *, source: str, policy_version: int, created: float,
                   extra: dict | None = None) -> bytes:
  """Episode + provenance -> one record (format in the module docstring)."""
  flat = episode_arrays(ep)
  rec = {
      "v": FORMAT_VERSION, "task": ep.task, "seed": int(ep.seed), "instruction": ep.instruction,
      "truncated": bool(ep.truncated), "lost": bool(ep.lost), "policy_version": int(ep.policy_version),
      "prefix_ids": _arr(ep.prefix_ids, _I4),
      "turns": [{
          "image_png": encode_png(t.image), "obs_ids": _arr(t.obs_ids, _I4), "reply_ids": _arr(t.reply_ids, _I4),
          "logprobs": _arr(t.logprobs, _F4), "states": _arr(t.states, _I4), "text": t.text,
          "reward": float(t.reward), "env_reward": float(t.env_reward), "done": bool(t.done), "error": t.error,
          "info": t.info} for t in ep.turns],
      "flat": {"tokens": _arr(flat["tokens"], _I4), "loss": _arr(flat["loss"], _F4),
               "reward": _arr(flat["reward"], _F4), "logp": _arr(flat["logp"], _F4),
               "state": _arr(flat["state"], _I4)},
      "provenance": {"source": source, "task": ep.task, "seed": int(ep.seed), "policy_version": int(policy_version),
                     "created": float(created), "extra": dict(extra or {})},
  }
  return msgpack.packb(rec, use_bin_type=True, default=_plain)


def decode_episode(data: bytes, image_hw: tuple[int, int] | None = None) -> tuple[Episode, dict]:
  """One record -> (Episode, provenance dict).

  Checks the images against `image_hw` (when given) and the stored flat token view against the one
  recomputed from the turns.
  Raises: ValueError (or the decoder's own exception) for anything malformed; `episodes` turns these
    into `CorruptRecord` with the shard and index.
  """
  rec = msgpack.unpackb(data, raw=False, strict_map_key=False)  # info / extra may have int keys
  if not isinstance(rec, dict) or not isinstance(rec.get("v"), int):
    raise ValueError(f"not a trajectory record (got {type(rec).__name__})")
  if rec["v"] != FORMAT_VERSION:
    raise ValueError(f"record format version {rec['v']}, this reader reads {FORMAT_VERSION}")
  turns = []
  for t in rec["turns"]:
    image = decode_png(t["image_png"])
    if image_hw is not None and image.shape[:2] != tuple(image_hw):
      raise ValueError(f"image of shape {image.shape} in a dataset of image_hw {tuple(image_hw)}")
    turns.append(Turn(image=image, obs_ids=_ids(t["obs_ids"]), reply_ids=_ids(t["reply_ids"]),
                      logprobs=np.frombuffer(t["logprobs"], _F4).copy(),
                      states=np.frombuffer(t["states"], _I4).copy(), text=t["text"], reward=float(t["reward"]),
                      env_reward=float(t["env_reward"]), done=bool(t["done"]), error=t["error"], info=t["info"]))
  ep = Episode(task=rec["task"], seed=int(rec["seed"]), instruction=rec["instruction"],
               prefix_ids=_ids(rec["prefix_ids"]), turns=turns, truncated=bool(rec["truncated"]),
               lost=bool(rec["lost"]), policy_version=int(rec["policy_version"]))
  flat = episode_arrays(ep)
  for k, dtype in (("tokens", _I4), ("loss", _F4), ("reward", _F4), ("logp", _F4), ("state", _I4)):
    if not np.array_equal(np.frombuffer(rec["flat"][k], dtype), flat[k]):
      raise ValueError(f"stored flat {k!r} differs from the one of its turns")
  prov = rec["provenance"]
  if not isinstance(prov, dict) or not isinstance(prov.get("source"), str):
    raise ValueError("record has no provenance source")
  return ep, prov


# ------------------------------------------------------------------------------------------------- index file

def read_index(directory: str) -> dict:
  """Contents of <directory>/dataset.json: {"version", "meta", "shards": [{"file", "records"}],
  "counts": {source: {task: episodes}}}.

  Raises: FileNotFoundError when the directory has no dataset.json (nothing committed there).
  """
  path = os.path.join(directory, INDEX_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no {INDEX_FILE} in {directory} (not a records dataset, or no writer closed yet)")
  with open(path) as f:
    index = json.load(f)
  if index.get("version") != INDEX_VERSION:
    raise ValueError(f"{path}: index version {index.get('version')}, this reader reads {INDEX_VERSION}")
  return index


def prefix_committed(directory: str, prefix: str) -> bool:
  """Whether `directory`'s dataset.json lists shards of writer prefix `prefix` (a `RecordWriter` with
  that prefix has closed there); False for a directory without a dataset.json."""
  if not os.path.exists(os.path.join(directory, INDEX_FILE)):
    return False
  return any(s["file"].startswith(prefix + "-") for s in read_index(directory)["shards"])


def load_meta(dirs: str | Sequence[str]) -> DatasetMeta:
  """The one DatasetMeta of one or several dataset directories.

  Raises: DatasetMismatch naming the field and both directories' values when they differ;
    FileNotFoundError for a directory without dataset.json.
  """
  dirs = _as_dirs(dirs)
  metas = [DatasetMeta.from_json(read_index(d)["meta"]) for d in dirs]
  for d, m in zip(dirs[1:], metas[1:]):
    for name in _diff(metas[0], m):
      raise DatasetMismatch(f"{name}={getattr(metas[0], name)!r} in {dirs[0]} but {name}={getattr(m, name)!r} in {d}")
  return metas[0]


def _as_dirs(dirs) -> list[str]:
  dirs = [dirs] if isinstance(dirs, (str, os.PathLike)) else list(dirs)
  if not dirs:
    raise ValueError("no dataset directories given")
  return [os.fspath(d) for d in dirs]


@contextlib.contextmanager
def _locked(directory: str):
  """Exclusive lock on the directory's index (several writers closing at once)."""
  with open(os.path.join(directory, ".dataset.lock"), "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _write_index(directory: str, index: dict) -> None:
  tmp = os.path.join(directory, INDEX_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump(index, f, indent=1, sort_keys=True)
  os.replace(tmp, os.path.join(directory, INDEX_FILE))  # atomic: readers see the old or the new index


# ----------------------------------------------------------------------------------------------------- writer

class RecordWriter:
  """Writes episodes into ArrayRecord shards `<directory>/<prefix>-NNNNN.array_record`; `close` (or
  leaving the `with` block, also on an exception: what was written is whole) adds them to dataset.json.

  Raises (constructor): DatasetMismatch when the directory already holds a dataset of another meta;
    FileExistsError when shards of `prefix` are already committed there (pick another prefix).
  """

  def __init__(self, directory: str, meta: DatasetMeta, *, prefix: str = "records", records_per_shard: int = 1024):
    if records_per_shard <= 0:
      raise ValueError(f"records_per_shard must be positive, got {records_per_shard}")
    if not prefix or os.sep in prefix:
      raise ValueError(f"bad shard prefix {prefix!r}")
    self.directory, self.meta, self.prefix = os.fspath(directory), meta, prefix
    self.records_per_shard = records_per_shard
    self._mine = re.compile(re.escape(prefix) + r"-\d{5,}" + re.escape(SHARD_SUFFIX))
    os.makedirs(self.directory, exist_ok=True)
    with _locked(self.directory):
      if os.path.exists(os.path.join(self.directory, INDEX_FILE)):
        index = read_index(self.directory)
        old = DatasetMeta.from_json(index["meta"])
        for name in _diff(old, meta):
          raise DatasetMismatch(f"{self.directory} holds {name}={getattr(old, name)!r}, writer has "
                                f"{name}={getattr(meta, name)!r}")
        taken = [s["file"] for s in index["shards"] if self._mine.fullmatch(s["file"])]
        if taken:
          raise FileExistsError(f"shards of prefix {prefix!r} already committed in {self.directory}: {taken[:3]}")
    # Shards of this prefix not in the index: left by a writer killed before close; redo them.
    for name in sorted(os.listdir(self.directory)):
      if self._mine.fullmatch(name):
        logging.warning("removing uncommitted shard %s", os.path.join(self.directory, name))
        os.remove(os.path.join(self.directory, name))
    self._writer = None
    self._n_in_shard = 0
    self._shards: list[dict] = []
    self._counts: dict[str, dict[str, int]] = {}
    self._closed = False

  def __enter__(self) -> "RecordWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _check(self, ep: Episode, source: str) -> None:
    if not isinstance(source, str) or not source:
      raise ValueError(f"source must be a non-empty string, got {source!r}")
    h, w = self.meta.image_hw
    image_id = tokenizer_lib.IMAGE if self.meta.tokenizer == "byte" else None
    ids = list(ep.prefix_ids)
    for i, t in enumerate(ep.turns):
      img = np.asarray(t.image)
      if img.dtype != np.uint8 or img.shape != (h, w, 3):
        raise ValueError(f"turn {i} of {ep.task}/{ep.seed}: image {img.dtype}{list(img.shape)}, dataset stores "
                         f"uint8[{h}, {w}, 3]")
      if len(t.logprobs) != len(t.reply_ids) or len(t.states) != len(t.reply_ids):
        raise ValueError(f"turn {i} of {ep.task}/{ep.seed}: {len(t.reply_ids)} reply ids but "
                         f"{len(t.logprobs)} logprobs, {len(t.states)} states")
      if image_id is not None and t.obs_ids.count(image_id) != self.meta.n_img_tokens:
        raise ValueError(f"turn {i} of {ep.task}/{ep.seed}: {t.obs_ids.count(image_id)} IMAGE ids in obs_ids, "
                         f"dataset has n_img_tokens={self.meta.n_img_tokens}")
      ids += t.obs_ids + t.reply_ids
    bad = [x for x in ids if not 0 <= x < self.meta.vocab_size]
    if bad:
      raise ValueError(f"{ep.task}/{ep.seed}: token ids {bad[:5]} outside vocab_size={self.meta.vocab_size}")

  def write(self, episode: Episode, *, source: str, policy_version: int | None = None,
            extra: dict | None = None) -> None:
    """Appends one episode as one record.

    source: 'expert' | 'grounding' | 'rollout' | ... (free string); policy_version: the version that
    produced it (None = `episode.policy_version`); extra: free msgpack-able map (e.g. reward terms).
    Raises: ValueError for an episode that does not fit the meta (image size, IMAGE slots, ids outside
      the vocabulary, logprobs / states not one per reply id); TypeError for an unstorable extra / info.
    """
    if self._closed:
      raise ValueError("write on a closed RecordWriter")
    self._check(episode, source)
    pv = episode.policy_version if policy_version is None else policy_version
    data = encode_episode(episode, source=source, policy_version=pv, created=time.time(), extra=extra)
    if self._writer is None:
      name = f"{self.prefix}-{len(self._shards):05d}{SHARD_SUFFIX}"
      self._writer = array_record_module.ArrayRecordWriter(os.path.join(self.directory, name), WRITER_OPTIONS)
      self._shards.append({"file": name, "records": 0})
    self._writer.write(data)
    self._shards[-1]["records"] += 1
    by_task = self._counts.setdefault(source, {})
    by_task[episode.task] = by_task.get(episode.task, 0) + 1
    if self._shards[-1]["records"] == self.records_per_shard:
      self._close_shard()

  def _close_shard(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def close(self) -> dict[str, dict[str, int]]:
    """Finishes the open shard and commits this writer's shards to dataset.json.

    Returns: this writer's episode counts {source: {task: n}} (dataset.json holds the totals).
    """
    if self._closed:
      return self._counts
    self._close_shard()
    self._closed = True
    with _locked(self.directory):
      path = os.path.join(self.directory, INDEX_FILE)
      index = read_index(self.directory) if os.path.exists(path) else {
          "version": INDEX_VERSION, "meta": self.meta.to_json(), "shards": [], "counts": {}}
      index["shards"] += self._shards
      for source, by_task in self._counts.items():
        total = index["counts"].setdefault(source, {})
        for task, n in by_task.items():
          total[task] = total.get(task, 0) + n
      _write_index(self.directory, index)
    return self._counts


# ----------------------------------------------------------------------------------------------------- reader

class CorruptCounter:
  """Counts the distinct corrupt records a pipeline skipped (thread-safe; a record read again in a
  later epoch counts once). Counts are per process: grain worker processes (mp_prefetch) keep their own.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self.records: set[tuple[str, int]] = set()

  def add(self, file: str, index: int) -> bool:
    with self._lock:
      new = (file, index) not in self.records
      self.records.add((file, index))
      return new

  @property
  def count(self) -> int:
    return len(self.records)

  def __getstate__(self):
    return {"records": set(self.records)}

  def __setstate__(self, state):
    self._lock, self.records = threading.Lock(), state["records"]


class _Shards:
  """grain RandomAccessDataSource over the shards of the dataset dirs: index -> (file, position, bytes
  or the read error). Read errors (a Riegeli chunk whose hash no longer matches) are returned, not
  raised, so the decoding map can name the record and skip it when asked."""

  def __init__(self, files: list[str], counts: list[int]):
    self.files = files
    self._ends = list(np.cumsum(counts).tolist())
    # "path[0:n]": record counts from dataset.json, so no shard is opened before it is read.
    self._source = grain.sources.ArrayRecordDataSource([f"{f}[0:{n}]" for f, n in zip(files, counts)])

  def __len__(self) -> int:
    return self._ends[-1]

  def __getitem__(self, index):
    index = int(index)
    k = bisect.bisect_right(self._ends, index)
    pos = index - (self._ends[k - 1] if k else 0)
    try:
      return self.files[k], pos, self._source[index], None
    except Exception as e:  # riegeli / reader errors are RuntimeError, ValueError, OSError: all "unreadable"
      return self.files[k], pos, None, f"{type(e).__name__}: {e}"


class _Decode:
  """(file, position, bytes, read error) -> (Episode, provenance), or None for a skipped corrupt record."""

  def __init__(self, image_hw, skip_corrupt: bool, counter: CorruptCounter):
    self.image_hw, self.skip_corrupt, self.counter = image_hw, skip_corrupt, counter

  def __call__(self, item):
    file, pos, data, error = item
    if error is None:
      try:
        return decode_episode(data, self.image_hw)
      except Exception as e:  # msgpack, PIL and layout errors alike mean the record is damaged
        error = f"{type(e).__name__}: {e}"
    if not self.skip_corrupt:
      raise CorruptRecord(file, pos, error)
    if self.counter.add(file, pos):
      logging.warning("skipping corrupt record %d of %s: %s", pos, file, error)
    return None


def _is_record(x) -> bool:
  return x is not None


def episodes(dirs: str | Sequence[str], *, skip_corrupt: bool = False,
             counter: CorruptCounter | None = None) -> grain.MapDataset:
  """All episodes of one or several dataset directories as a grain MapDataset of (Episode, provenance).

  Episode as written (Turn.image uint8 [H, W, 3] at DatasetMeta.image_hw, logprobs float32, states
  int32, ids as lists); provenance {"source", "task", "seed", "policy_version", "created" (unix s),
  "extra"}. Records are read and decoded lazily, on access (`ds[i]`, iteration). Order: dirs as
  given, then shards as listed in each dataset.json, then records. The dataset is the dirs'
  dataset.json at the time of the call (shards committed later are not seen). With skip_corrupt, a
  corrupt record's element is None (grain `filter`; iteration skips it) and it is counted in
  `counter` (also reachable as the returned dataset's `.corrupt`).

  Raises: FileNotFoundError (no dataset.json, or a listed shard missing); DatasetMismatch when the
    dirs' metas differ; EmptyDataset when they hold no records. On access, CorruptRecord (file and
    index) for an unreadable / undecodable record unless skip_corrupt.
  """
  dirs = _as_dirs(dirs)
  meta = load_meta(dirs)
  files, counts = [], []
  for d in dirs:
    for s in read_index(d)["shards"]:
      path = os.path.join(d, s["file"])
      if not os.path.exists(path):
        raise FileNotFoundError(f"shard {path} listed in {os.path.join(d, INDEX_FILE)} is missing")
      if s["records"]:
        files.append(path)
        counts.append(int(s["records"]))
  if not files:
    raise EmptyDataset(f"no records in {dirs}")
  counter = counter if counter is not None else CorruptCounter()
  ds = grain.MapDataset.source(_Shards(files, counts)).map(_Decode(meta.image_hw, skip_corrupt, counter))
  if skip_corrupt:
    ds = ds.filter(_is_record)
  ds.corrupt = counter
  return ds


def read_episodes(directory: str | Sequence[str], *, skip_corrupt: bool = False) -> list[tuple[Episode, dict]]:
  """Every (Episode, provenance) of a dataset, in `episodes` order (small datasets, tests)."""
  ds = episodes(directory, skip_corrupt=skip_corrupt)
  return [x for x in (ds[i] for i in range(len(ds))) if x is not None]


def __getattr__(name):
  # `records.batches` = `pipeline.batches` (the training iterator over `episodes`); lazy because
  # pipeline imports this module.
  if name == "batches":
    from tars_jax.data.pipeline import batches
    return batches
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
