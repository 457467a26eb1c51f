"""Trajectory records (tars_jax/data/records.py, pipeline.py): real ArrayRecord shards read through
real grain pipelines. Episodes are built by hand with random screenshots and real token ids (the
chat template's prefix / observation ids, reply bytes + EOS, grammar states from `grammar.walk`);
every read-back value is compared with the episode that was written."""

import collections
import json
import os

import msgpack
import numpy as np
import pytest
from array_record.python import array_record_module

from tars_jax.agent import grammar as grammar_lib
from tars_jax.agent.prompts import ChatTemplate
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode, Turn, bucket, collate, episode_arrays
from tars_jax.data import records
from tars_jax.data.pipeline import batches, num_tokens

HW = (12, 16)
N_IMG = 4
META = records.DatasetMeta(image_hw=HW, n_img_tokens=N_IMG, tokenizer="byte", vocab_size=264)
TPL = ChatTemplate(n_img_tokens=N_IMG)
SOURCES = ("expert", "grounding", "rollout")


@pytest.fixture(scope="module")
def grammar():
  return grammar_lib.build_grammar()


def make_episode(i: int, grammar, rng) -> Episode:
  """Episode i: 1-3 turns (lengths vary with i, so several length buckets), random screenshots,
  real ids; rollout-like fields (logprobs, rewards, errors, info) filled with distinct values."""
  turns = []
  n_turns = 1 + i % 3
  for k in range(n_turns):
    text = f"Thought: {'go' * (i % 5)}\nAction: click(start_box='({10 * i},{k})')"
    reply = TPL.reply(text)
    last = k == n_turns - 1
    turns.append(Turn(image=rng.integers(0, 256, (*HW, 3), dtype=np.uint8), obs_ids=TPL.observation(after_reply=k > 0),
                      reply_ids=reply, logprobs=rng.normal(size=len(reply)).astype(np.float32),
                      states=grammar_lib.walk(grammar, reply), text=text, reward=float(rng.normal()),
                      env_reward=1.0 if last and i % 2 else 0.0, done=last,
                      error="invalid action: x" if k == 1 else None,
                      info={"step": k, "elapsed_ms": np.float32(100.0 * k), "scores": np.arange(2)}))
  return Episode(task=f"click-{'abc'[i % 3]}", seed=1000 + i, instruction=f"click {i}",
                 prefix_ids=TPL.prefix(f"click {i}"), turns=turns, truncated=i % 4 == 3, policy_version=i % 2)


def write(directory, eps, prefix="records", records_per_shard=4, meta=META):
  with records.RecordWriter(str(directory), meta, prefix=prefix, records_per_shard=records_per_shard) as w:
    for i, ep in enumerate(eps):
      w.write(ep, source=SOURCES[i % 3], policy_version=7 + i, extra={"iteration": i, "tag": f"e{i}"})
  return w


def assert_same_episode(a: Episode, b: Episode):
  assert (a.task, a.seed, a.instruction, a.prefix_ids) == (b.task, b.seed, b.instruction, b.prefix_ids)
  assert (a.truncated, a.lost, a.policy_version) == (b.truncated, b.lost, b.policy_version)
  assert len(a.turns) == len(b.turns)
  for s, t in zip(a.turns, b.turns):
    assert t.image.dtype == np.uint8 and np.array_equal(s.image, t.image)
    assert (s.obs_ids, s.reply_ids, s.text, s.error) == (t.obs_ids, t.reply_ids, t.text, t.error)
    assert np.array_equal(s.logprobs, t.logprobs) and t.logprobs.dtype == np.float32
    assert np.array_equal(s.states, t.states) and t.states.dtype == np.int32
    assert (s.reward, s.env_reward, s.done) == (t.reward, t.env_reward, t.done)
  fa, fb = episode_arrays(a), episode_arrays(b)
  for k in fa:
    assert np.array_equal(fa[k], fb[k]), k


@pytest.fixture(scope="module")
def written(tmp_path_factory, grammar):
  rng = np.random.default_rng(0)
  eps = [make_episode(i, grammar, rng) for i in range(12)]
  eps.append(Episode(task="click-a", seed=5, instruction="", prefix_ids=[], lost=True))  # a lost episode: no turns
  d = tmp_path_factory.mktemp("ds")
  w = write(d, eps)
  return d, eps, w


def test_round_trip_through_grain(written):
  d, eps, _ = written
  ds = records.episodes(str(d))
  assert len(ds) == len(eps)
  got = list(ds.to_iter_dataset())  # grain's threaded reader
  assert len(got) == len(eps)
  for i, (ep, (back, prov)) in enumerate(zip(eps, got)):
    assert_same_episode(ep, back)
    assert back.turns == [] or back.turns[0].info == {"step": 0, "elapsed_ms": 0.0, "scores": [0, 1]}
    assert prov["source"] == SOURCES[i % 3] and prov["task"] == ep.task and prov["seed"] == ep.seed
    assert prov["policy_version"] == 7 + i and prov["extra"] == {"iteration": i, "tag": f"e{i}"}
    assert abs(prov["created"] - os.path.getmtime(d / "dataset.json")) < 600  # unix seconds of the write
  assert [e.seed for e, _ in records.read_episodes(str(d))] == [e.seed for e in eps]
  # the training iterator leaves the lost episode out (seed 5, the last one)
  it = records.batches(ds, seed=0, batch_size=4, num_epochs=1, collate_fn=lambda b: [e.seed for e in b])
  assert sorted(s for b in it for s in b) == [e.seed for e in eps[:-1]]


def test_shards_hold_the_documented_format(written):
  """A record read with array_record + msgpack alone (no tars_jax decoder) has the v1 layout: the loss
  mask and token view of `episode_arrays`, the screenshot as PNG of the same pixels."""
  d, eps, _ = written
  index = json.loads((d / "dataset.json").read_text())
  assert [s["records"] for s in index["shards"]] == [4, 4, 4, 1]  # records_per_shard=4, 13 episodes
  assert [s["file"] for s in index["shards"]] == [f"records-{k:05d}.array_record" for k in range(4)]
  reader = array_record_module.ArrayRecordReader(str(d / "records-00001.array_record"))
  assert reader.num_records() == 4
  rec = msgpack.unpackb(reader.read([2])[0])
  ep = eps[6]
  assert rec["v"] == 1 and rec["task"] == ep.task and len(rec["turns"]) == len(ep.turns)
  flat = episode_arrays(ep)
  assert np.array_equal(np.frombuffer(rec["flat"]["tokens"], "<i4"), flat["tokens"])
  assert np.array_equal(np.frombuffer(rec["flat"]["loss"], "<f4"), flat["loss"])
  assert np.frombuffer(rec["flat"]["loss"], "<f4").sum() == sum(len(t.reply_ids) for t in ep.turns) > 0
  assert rec["turns"][0]["image_png"][:8] == b"\x89PNG\r\n\x1a\n"
  assert np.array_equal(records.decode_png(rec["turns"][0]["image_png"]), ep.turns[0].image)
  assert rec["provenance"]["source"] == SOURCES[6 % 3]


def test_dataset_json_counts_what_was_written(written):
  d, eps, w = written
  expected = collections.defaultdict(dict)
  for i, ep in enumerate(eps):
    expected[SOURCES[i % 3]][ep.task] = expected[SOURCES[i % 3]].get(ep.task, 0) + 1
  index = records.read_index(str(d))
  assert index["counts"] == expected == w.close()
  assert sum(s["records"] for s in index["shards"]) == len(eps)
  assert records.load_meta(str(d)) == META


def test_writers_of_several_iterations_read_as_one_dataset(tmp_path, grammar):
  rng = np.random.default_rng(1)
  eps = [make_episode(i, grammar, rng) for i in range(7)]
  write(tmp_path, eps[:3], prefix="iter_00000")
  write(tmp_path, eps[3:], prefix="iter_00001", records_per_shard=2)
  got = records.read_episodes(str(tmp_path))
  assert [e.seed for e, _ in got] == [e.seed for e in eps]
  for ep, (back, _) in zip(eps, got):
    assert_same_episode(ep, back)
  index = records.read_index(str(tmp_path))
  assert [s["file"] for s in index["shards"]] == ["iter_00000-00000.array_record"] + [
      f"iter_00001-{k:05d}.array_record" for k in range(2)]
  # counts add up across writers. Sources cycle per writer (its own i % 3), tasks with the episode:
  # writer 0: expert/a, grounding/b, rollout/c; writer 1: expert/a, grounding/b, rollout/c, expert/a
  assert index["counts"] == {"expert": {"click-a": 3}, "grounding": {"click-b": 2}, "rollout": {"click-c": 2}}
  with pytest.raises(FileExistsError, match="iter_00001"):
    records.RecordWriter(str(tmp_path), META, prefix="iter_00001")
  other = records.DatasetMeta(image_hw=HW, n_img_tokens=N_IMG + 1, tokenizer="byte", vocab_size=264)
  with pytest.raises(records.DatasetMismatch, match="n_img_tokens=4.*n_img_tokens=5"):
    records.RecordWriter(str(tmp_path), other, prefix="iter_00002")


def test_uncommitted_shards_of_a_killed_writer_are_ignored_then_redone(tmp_path, grammar):
  rng = np.random.default_rng(2)
  eps = [make_episode(i, grammar, rng) for i in range(4)]
  write(tmp_path, eps[:2], prefix="iter_00000")
  killed = records.RecordWriter(str(tmp_path), META, prefix="iter_00001")
  killed.write(eps[2], source="rollout")
  killed._close_shard()  # the shard is on disk, but the writer never reached close()
  assert [e.seed for e, _ in records.read_episodes(str(tmp_path))] == [eps[0].seed, eps[1].seed]
  write(tmp_path, eps[2:], prefix="iter_00001")  # the rerun of that iteration
  assert [e.seed for e, _ in records.read_episodes(str(tmp_path))] == [e.seed for e in eps]


def test_check_compatible_names_field_and_values():
  model = dict(image_hw=HW, n_img_tokens=N_IMG, tokenizer="byte", vocab_size=264)
  records.check_compatible(META, **model)
  for field, value, msg in [("image_hw", (24, 16), r"image_hw=\(12, 16\).*image_hw=\(24, 16\)"),
                            ("n_img_tokens", 9, "n_img_tokens=4.*n_img_tokens=9"),
                            ("tokenizer", "qwen", "tokenizer='byte'.*tokenizer='qwen'"),
                            ("vocab_size", 151936, "vocab_size=264.*vocab_size=151936")]:
    with pytest.raises(records.DatasetMismatch, match=msg):
      records.check_compatible(META, **dict(model, **{field: value}))


def test_dirs_of_different_meta_and_empty_datasets_raise(tmp_path, grammar):
  rng = np.random.default_rng(3)
  a, b, empty = tmp_path / "a", tmp_path / "b", tmp_path / "empty"
  write(a, [make_episode(0, grammar, rng)])
  other = records.DatasetMeta(image_hw=HW, n_img_tokens=N_IMG, tokenizer="byte", vocab_size=300)
  write(b, [make_episode(1, grammar, rng)], meta=other)
  with pytest.raises(records.DatasetMismatch, match=f"vocab_size=264 in {a} but vocab_size=300 in {b}"):
    records.episodes([str(a), str(b)])
  write(empty, [])
  with pytest.raises(records.EmptyDataset, match="empty"):
    records.episodes(str(empty))
  with pytest.raises(FileNotFoundError, match="nowhere"):
    records.episodes(str(tmp_path / "nowhere"))
  assert len(records.episodes([str(a), str(a)])) == 2  # same meta: one dataset


def test_writer_refuses_episodes_that_do_not_fit_the_meta(tmp_path, grammar):
  rng = np.random.default_rng(4)
  with records.RecordWriter(str(tmp_path), META) as w:
    ep = make_episode(1, grammar, rng)
    ep.turns[1].image = np.zeros((24, 16, 3), np.uint8)
    with pytest.raises(ValueError, match=r"turn 1 .*uint8\[24, 16, 3\].*uint8\[12, 16, 3\]"):
      w.write(ep, source="expert")
    ep = make_episode(1, grammar, rng)
    ep.turns[0].obs_ids = TPL.observation()[:-2] + [TPL.tokenizer.vision_end_id]  # one IMAGE slot short
    with pytest.raises(ValueError, match="3 IMAGE ids.*n_img_tokens=4"):
      w.write(ep, source="expert")
    ep = make_episode(1, grammar, rng)
    ep.prefix_ids = ep.prefix_ids + [264]
    with pytest.raises(ValueError, match=r"\[264\] outside vocab_size=264"):
      w.write(ep, source="expert")
    with pytest.raises(ValueError, match="source"):
      w.write(make_episode(1, grammar, rng), source="")
  assert w.close() == {}


def _common_prefix(a: bytes, b: bytes) -> int:
  n = min(len(a), len(b))
  return next((i for i in range(n) if a[i] != b[i]), n)


def _damage_record(path, k: int, tmp_path) -> None:
  """Flips one byte in the middle of record k's stored payload (its Riegeli chunk) in a shard.

  Where the chunk lies: records are written as consecutive chunks (group_size:1), so it starts where
  the shard stops agreeing with a shard of records 0..k-1 alone and ends where it stops agreeing
  with one of records 0..k (both rewritten here with the same writer options).
  """
  reader = array_record_module.ArrayRecordReader(str(path))
  raw = [reader.read([i])[0] for i in range(k + 1)]
  reader.close()
  shard = path.read_bytes()
  ends = []
  for n in (k, k + 1):
    w = array_record_module.ArrayRecordWriter(str(tmp_path / "prefix.array_record"), records.WRITER_OPTIONS)
    for r in raw[:n]:
      w.write(r)
    w.close()
    ends.append(_common_prefix(shard, (tmp_path / "prefix.array_record").read_bytes()))
  start, end = ends
  assert end - start > 100, (start, end)
  data = bytearray(shard)
  data[(start + end) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


def test_damaged_record_raises_with_file_and_index_or_is_skipped_and_counted(tmp_path, grammar):
  rng = np.random.default_rng(5)
  eps = [make_episode(i, grammar, rng) for i in range(9)]
  write(tmp_path, eps)
  shard = tmp_path / "records-00001.array_record"
  _damage_record(shard, 1, tmp_path)  # episode 5 = record 1 of shard 1 (4 records per shard)
  ds = records.episodes(str(tmp_path))
  for i in (4, 6, 8):
    assert ds[i][0].seed == eps[i].seed  # the neighbours are intact
  with pytest.raises(records.CorruptRecord) as e:
    ds[5]
  assert e.value.file == str(shard) and e.value.index == 1 and "hash mismatch" in str(e.value)
  with pytest.raises(records.CorruptRecord, match="record 1 of .*records-00001.array_record"):
    list(ds.to_iter_dataset())

  counter = records.CorruptCounter()
  ds = records.episodes(str(tmp_path), skip_corrupt=True, counter=counter)
  assert ds.corrupt is counter
  assert [ep.seed for ep, _ in ds.to_iter_dataset()] == [ep.seed for i, ep in enumerate(eps) if i != 5]
  assert ds[5] is None and counter.count == 1 and counter.records == {(str(shard), 1)}
  # the training pipeline skips it too, and two epochs still count one distinct record
  it = batches(ds, seed=0, batch_size=2, num_epochs=2, collate_fn=lambda b: [e.seed for e in b])
  seen = [s for batch in it for s in batch]
  assert sorted(seen) == sorted(2 * [ep.seed for i, ep in enumerate(eps) if i != 5])
  assert counter.count == 1


def test_garbage_records_written_by_array_record_are_corrupt(tmp_path, grammar):
  """Records that array_record reads fine but that are not episodes: random bytes, a msgpack map of
  another layout, and a record whose flat token view disagrees with its turns."""
  rng = np.random.default_rng(6)
  eps = [make_episode(i, grammar, rng) for i in range(4)]
  write(tmp_path, eps, records_per_shard=8)
  shard = tmp_path / "records-00000.array_record"
  reader = array_record_module.ArrayRecordReader(str(shard))
  raw = [reader.read([i])[0] for i in range(4)]
  reader.close()
  bad_flat = msgpack.unpackb(raw[3])
  bad_flat["flat"]["loss"] = np.zeros(len(episode_arrays(eps[3])["loss"]), "<f4").tobytes()
  raw[0] = rng.bytes(200)
  raw[1] = msgpack.packb({"v": 1, "task": "x"})
  raw[3] = msgpack.packb(bad_flat)
  w = array_record_module.ArrayRecordWriter(str(shard), records.WRITER_OPTIONS)
  for r in raw:
    w.write(r)
  w.close()
  ds = records.episodes(str(tmp_path))
  for i, why in [(0, "record 0 of"), (1, "KeyError"), (3, "flat 'loss'")]:
    with pytest.raises(records.CorruptRecord, match=why) as e:
      ds[i]
    assert (e.value.file, e.value.index) == (str(shard), i)
  assert_same_episode(ds[2][0], eps[2])
  counter = records.CorruptCounter()
  kept = list(records.episodes(str(tmp_path), skip_corrupt=True, counter=counter).to_iter_dataset())
  assert [e.seed for e, _ in kept] == [eps[2].seed] and counter.count == 3


@pytest.fixture(scope="module")
def pool(tmp_path_factory, grammar):
  """40 episodes in one dataset, of ~7 length buckets at length_multiple=16."""
  rng = np.random.default_rng(7)
  eps = [make_episode(i, grammar, rng) for i in range(40)]
  d = tmp_path_factory.mktemp("pool")
  write(d, eps, records_per_shard=16)
  return str(d), eps


def _seeds(batch):
  return {"seed": np.array([e.seed for e in batch]), "len": np.array([num_tokens(e) for e in batch])}


def test_epochs_cover_every_episode_once_in_batches_of_one_bucket(pool):
  d, eps = pool
  m, bs = 16, 3
  out = list(batches(records.episodes(d), seed=3, batch_size=bs, num_epochs=2, length_multiple=m, collate_fn=_seeds))
  buckets = {bucket(num_tokens(e), m) for e in eps}
  assert len(buckets) > 3
  epochs, cur, n = [], [], 0
  for b in out:
    assert len({bucket(int(x), m) for x in b["len"]}) == 1  # one bucket per batch
    cur += b["seed"].tolist()
    if len(cur) == len(eps):
      epochs.append(cur)
      cur = []
  assert cur == [] and len(epochs) == 2  # batches never straddle an epoch
  for ep_seeds in epochs:
    assert sorted(ep_seeds) == sorted(e.seed for e in eps)
  assert epochs[0] != epochs[1]  # reshuffled per epoch
  full = [b for b in out if len(b["seed"]) == bs]
  assert len(out) - len(full) <= 2 * len(buckets)  # at most one smaller batch per bucket and epoch
  # the seed decides the order; the same seed gives the same batches
  again = list(batches(records.episodes(d), seed=3, batch_size=bs, num_epochs=2, length_multiple=m, collate_fn=_seeds))
  assert all(np.array_equal(a["seed"], b["seed"]) for a, b in zip(out, again)) and len(again) == len(out)
  other = list(batches(records.episodes(d), seed=4, batch_size=bs, num_epochs=2, length_multiple=m, collate_fn=_seeds))
  assert [b["seed"].tolist() for b in other] != [b["seed"].tolist() for b in out]


def test_processes_get_disjoint_shares_that_cover_the_dataset(pool):
  d, eps = pool
  shares = []
  for p in range(3):
    it = batches(records.episodes(d), seed=11, batch_size=2, num_epochs=1, process_index=p, process_count=3,
                 length_multiple=16, collate_fn=_seeds)
    shares.append([s for b in it for s in b["seed"].tolist()])
  assert [len(s) for s in shares] == [14, 13, 13]
  assert sorted(shares[0] + shares[1] + shares[2]) == sorted(e.seed for e in eps)  # disjoint + covering
  with pytest.raises(ValueError, match="process_index=3"):
    batches(records.episodes(d), seed=0, batch_size=2, process_index=3, process_count=3, collate_fn=_seeds)
  with pytest.raises(records.EmptyDataset, match="process 40 of 41"):
    batches(records.episodes(d), seed=0, batch_size=2, process_index=40, process_count=41, collate_fn=_seeds)


def test_resumed_iterator_continues_with_the_same_batches(pool):
  d, _ = pool

  def pipeline(seed=5):
    collate_fn = lambda eps: collate(eps, pad_id=ByteTokenizer().pad_id, max_images=3, image_hw=HW, length_multiple=16,
                                     batch_size=4).as_dict()
    return batches(records.episodes(d), seed=seed, batch_size=4, length_multiple=16, collate_fn=collate_fn)

  it = iter(pipeline())
  for _ in range(5):
    next(it)
  state = it.get_state()
  assert state["pending"]  # episodes are waiting in part-filled buckets
  want = [next(it) for _ in range(12)]  # repeats forever: crosses epoch boundaries (40 episodes each)
  fresh = iter(pipeline())
  fresh.set_state(json.loads(json.dumps(state)))
  got = [next(fresh) for _ in range(12)]
  for a, b in zip(want, got):
    assert a.keys() == b.keys()
    for k in a:
      assert np.array_equal(a[k], b[k]), k
  assert len({w["tokens"].shape[1] for w in want}) > 1  # several buckets -> several padded lengths
  with pytest.raises(ValueError, match="seed=5 saved, 6 here"):
    iter(pipeline(seed=6)).set_state(state)


def test_resume_from_every_point_including_end_of_epoch_flushes(pool):
  d, eps = pool
  make = lambda: iter(batches(records.episodes(d), seed=9, batch_size=3, length_multiple=16, collate_fn=_seeds))
  it, states, seq = make(), [], []
  for _ in range(24):  # > 1 epoch of 40 episodes (batches of 3, up to one smaller per bucket)
    states.append(json.loads(json.dumps(it.get_state())))
    seq.append(next(it)["seed"].tolist())
  flushes = [k for k, st in enumerate(states) if st["next_index"] % len(eps) == 0 and st["pending"]]
  assert flushes  # some states were taken while part-filled buckets were being emptied at an epoch end
  for k in range(len(states) - 3):
    fresh = make()
    fresh.set_state(states[k])
    assert [next(fresh)["seed"].tolist() for _ in range(3)] == seq[k:k + 3], k
