"""Data flywheel: rejection sampling, validation and routing of the policy's own trajectories
(UI-TARS-2 report section 2.3 and its flywheel figure; the RFT of section 2.4.2).

In iteration t the current policy (the previous iteration's RL model; iteration 1: the run given as
`flywheel.init`) samples k trajectories per task through the normal rollout path
(`rollout.evaluation.play` = `agent_loop.run_episodes`, called by experiments/flywheel.py). A validation function V scores each one:

  verifier  V = 1 when the environment's own check passed: `Episode.success` (done with a positive raw
            reward: MiniWoB++'s reward, a game's verifier, a desktop task's check, a GUI-Browsing
            answer's exact match are all the sandbox's reward), or a task-specific check on the episode
  ORM       V = 1[p_yes > threshold] of an outcome reward model (`tars_jax.train.orm.OrmScorer`)

and `route` sends V = 1 to the SFT set and V = 0 to the CT set: every sample lands in exactly one of
them. A lost episode (its sandbox session died on every retry: `Episode.lost`) has no verdict: it is
counted as `lost` and lands in neither set.

On disk (experiments/flywheel.py, under the flywheel's run dir R):

  R/iter_<t>/generate/samples/     every sample of iteration t, lost ones included (`write_samples`):
                                   the iteration's staging set, committed in one writer
  R/data/sft, R/data/ct            the accumulated sets (`route_records`): shards of prefix
                                   `iter_<t:05d>` per iteration; an iteration already committed there is
                                   never written again
  R/iter_<t>/generate/counts.json  `IterationCounts` of the iteration (written last: the stage's commit)

Every record has provenance source 'flywheel', policy_version = t - 1 (the version of the policy that
sampled it; 0 = the initial policy) and extra {iteration, v, validator, env_return, policy, p_yes (ORM
only)}.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Mapping, Sequence

import numpy as np

from tars_jax.agent.trajectory import Episode
from tars_jax.data import records

SOURCE = "flywheel"  # provenance source of every flywheel record
SETS = ("sft", "ct")  # V = 1 -> "sft", V = 0 -> "ct"
LOST = -1  # the verdict of a lost episode: no V, in neither set
VALIDATORS = ("verifier", "orm")
_PREFIX = re.compile(r"iter_(\d{5,})-")  # a shard of iteration t in the sets: iter_<t:05d>-NNNNN.array_record

Check = Callable[[Episode], bool]


# ------------------------------------------------------------------------------------------- validation

def verify(episodes: Sequence[Episode], checks: Mapping[str, Check] | None = None) -> np.ndarray:
  """Verifier verdicts: int8 [N], 1 when the episode passed, 0 when it did not, `LOST` (-1) for a lost one.

  Passed = `checks[task](episode)` for a task with a check (keyed by the full task name, or by its family
  prefix such as 'games/'), else `Episode.success` (done with a positive environment return: the
  sandbox's verifier).
  """
  checks = dict(checks or {})
  out = np.empty(len(episodes), np.int8)
  for i, ep in enumerate(episodes):
    if ep.lost:
      out[i] = LOST
      continue
    check = checks.get(ep.task) or checks.get(ep.task.split("/")[0] + "/")
    out[i] = bool(check(ep)) if check is not None else ep.success
  return out


def orm_verdicts(episodes: Sequence[Episode], scorer, threshold: float) -> tuple[np.ndarray, np.ndarray]:
  """ORM verdicts: (V int8 [N] = 1[p_yes > threshold], `LOST` for lost episodes; p_yes float32 [N],
  NaN for lost ones). `scorer.p_yes(episodes) -> float32 [M]` (`tars_jax.train.orm.OrmScorer`) is asked
  about the M episodes that are not lost, in order.

  Raises: ValueError when the threshold is outside [0, 1] or the scorer returns another shape or
    values that are not probabilities.
  """
  if not 0.0 <= threshold <= 1.0:
    raise ValueError(f"ORM threshold must be in [0, 1], got {threshold}")
  keep = [i for i, ep in enumerate(episodes) if not ep.lost]
  p = np.full(len(episodes), np.nan, np.float32)
  if keep:
    got = np.asarray(scorer.p_yes([episodes[i] for i in keep]), np.float32)
    if got.shape != (len(keep),):
      raise ValueError(f"ORM p_yes returned shape {got.shape} for {len(keep)} episodes")
    if not np.all((got >= 0) & (got <= 1)):
      raise ValueError(f"ORM p_yes outside [0, 1]: {got[~((got >= 0) & (got <= 1))][:5]}")
    p[keep] = got
  v = np.full(len(episodes), LOST, np.int8)
  v[keep] = p[keep] > threshold
  return v, p


# ---------------------------------------------------------------------------------------------- routing

@dataclasses.dataclass
class IterationCounts:
  """Counts of one flywheel iteration: `generated` = v1 + v0 + lost (every sample, per task too).

  `corrupt` = staged records skipped as corrupt (only with skip_corrupt; they count nowhere else).
  """

  iteration: int = 0
  generated: int = 0
  v1: int = 0
  v0: int = 0
  lost: int = 0
  corrupt: int = 0
  per_task: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

  @property
  def v1_fraction(self) -> float:
    """v1 / (v1 + v0): the share of validated samples with V = 1 (lost ones excluded); NaN for none."""
    n = self.v1 + self.v0
    return self.v1 / n if n else float("nan")

  def add(self, task: str, v: int) -> None:
    key = {1: "v1", 0: "v0", LOST: "lost"}[int(v)]
    t = self.per_task.setdefault(task, {"generated": 0, "v1": 0, "v0": 0, "lost": 0})
    t["generated"] += 1
    t[key] += 1
    self.generated += 1
    setattr(self, key, getattr(self, key) + 1)

  def as_dict(self) -> dict:
    """Plain JSON (`v1_fraction` None where nothing was validated), per task with its own fraction."""
    def frac(c):
      return c["v1"] / (c["v1"] + c["v0"]) if c["v1"] + c["v0"] else None

    per_task = {task: {**c, "v1_fraction": frac(c)} for task, c in sorted(self.per_task.items())}
    return {**dataclasses.asdict(self), "per_task": per_task, "v1_fraction": frac(dataclasses.asdict(self))}

  @classmethod
  def from_dict(cls, d: dict) -> "IterationCounts":
    per_task = {t: {k: int(c[k]) for k in ("generated", "v1", "v0", "lost")} for t, c in d["per_task"].items()}
    return cls(iteration=int(d["iteration"]), generated=int(d["generated"]), v1=int(d["v1"]), v0=int(d["v0"]),
               lost=int(d["lost"]), corrupt=int(d.get("corrupt", 0)), per_task=per_task)


def route(episodes: Sequence[Episode], v: Sequence[int], iteration: int = 0
          ) -> tuple[list[int], list[int], IterationCounts]:
  """Routes samples by their verdicts: (indices of the SFT set (V = 1), indices of the CT set (V = 0),
  counts). Every sample that is not lost lands in exactly one of the two sets; a lost one (`Episode.lost`,
  whose verdict must be `LOST`) in neither, counted as `lost`.

  Raises: ValueError when `v` has another length than `episodes`, a verdict is not 1, 0 or LOST, a lost
    episode has a verdict other than LOST or a kept one has LOST.
  """
  v = np.asarray(v)
  if v.shape != (len(episodes),):
    raise ValueError(f"{len(episodes)} episodes but verdicts of shape {v.shape}")
  sft, ct, counts = [], [], IterationCounts(iteration=iteration)
  for i, (ep, x) in enumerate(zip(episodes, v.tolist())):
    if x not in (1, 0, LOST):
      raise ValueError(f"verdict {x!r} of sample {i} ({ep.task}/{ep.seed}): expected 1, 0 or {LOST} (lost)")
    if (x == LOST) != bool(ep.lost):
      raise ValueError(f"sample {i} ({ep.task}/{ep.seed}): lost={ep.lost} but verdict {x}")
    counts.add(ep.task, x)
    if x == 1:
      sft.append(i)
    elif x == 0:
      ct.append(i)
  return sft, ct, counts


# ------------------------------------------------------------------------------------------- generation

def sample_jobs(tasks: Sequence[str], seeds_per_task: int, samples_per_seed: int, iteration: int,
                seed_offset: int, eval_seed_offset: int) -> list[tuple[str, int]]:
  """(task, seed) jobs of iteration t (1-based): seeds `seed_offset + (t - 1) * seeds_per_task + j`,
  j < seeds_per_task, each played `samples_per_seed` times (k = seeds_per_task x samples_per_seed
  samples per task; the repeats differ by their sampling keys). Iterations never share a seed.

  Raises: ValueError for counts < 1, iteration < 1, or seeds reaching the evaluation seeds.
  """
  if seeds_per_task < 1 or samples_per_seed < 1 or iteration < 1:
    raise ValueError(f"need seeds_per_task, samples_per_seed, iteration >= 1, got {seeds_per_task}, "
                     f"{samples_per_seed}, {iteration}")
  first = seed_offset + (iteration - 1) * seeds_per_task
  if first + seeds_per_task > eval_seed_offset:
    raise ValueError(f"flywheel seeds {first}..{first + seeds_per_task - 1} of iteration {iteration} reach the "
                     f"evaluation seeds ({eval_seed_offset}+)")
  return [(task, first + j) for task in tasks for j in range(seeds_per_task) for _ in range(samples_per_seed)]


# ---------------------------------------------------------------------------------------------- records

def prefix(iteration: int) -> str:
  """Shard prefix of iteration t in the accumulated sets: 'iter_0000t'."""
  return f"iter_{iteration:05d}"


def write_samples(directory: str, episodes: Sequence[Episode], v: Sequence[int], meta: records.DatasetMeta, *,
                  iteration: int, validator: str, policy: str, p_yes: Sequence[float] | None = None,
                  pfx: str = "samples") -> dict:
  """Writes every sample of an iteration (lost ones included) into `directory` in one writer (one commit),
  provenance source 'flywheel', policy version = the episode's, extra {iteration, v, validator,
  env_return, policy, p_yes}. Returns the writer's counts.

  Raises: ValueError for an unknown validator or mismatched lengths; `RecordWriter`'s errors
    (FileExistsError when the samples are already committed there).
  """
  if validator not in VALIDATORS:
    raise ValueError(f"validator {validator!r}, expected one of {VALIDATORS}")
  v = np.asarray(v)
  route(episodes, v, iteration)  # checks the verdicts before anything is written
  if p_yes is not None and len(p_yes) != len(episodes):
    raise ValueError(f"{len(episodes)} episodes but {len(p_yes)} ORM scores")
  with records.RecordWriter(directory, meta, prefix=pfx) as w:
    for i, ep in enumerate(episodes):
      extra = {"iteration": int(iteration), "v": int(v[i]), "validator": validator,
               "env_return": float(ep.env_return), "policy": policy}
      if p_yes is not None:
        extra["p_yes"] = float(p_yes[i])
      w.write(ep, source=SOURCE, extra=extra)
  return w.close()


def route_records(samples_dir: str, root: str, iteration: int, *, skip_corrupt: bool = False
                  ) -> IterationCounts:
  """Routes an iteration's committed samples (`write_samples`) into `<root>/data/sft` (V = 1) and
  `<root>/data/ct` (V = 0) under the shard prefix `prefix(iteration)`, by the verdict in each record's
  provenance; lost samples go to neither. A set whose prefix is already committed is not written again
  (a re-run after a kill writes only what is missing), so each sample is in the sets at most once.

  Returns the iteration's counts (from the samples; `corrupt` = records skipped with skip_corrupt).
  Raises: records.CorruptRecord (file and index) for a damaged sample unless skip_corrupt;
    FileNotFoundError when `samples_dir` holds no committed samples; ValueError for a sample of another
    iteration or an inconsistent verdict.
  """
  counter = records.CorruptCounter()
  try:
    ds = records.episodes(samples_dir, skip_corrupt=skip_corrupt, counter=counter)
    pairs = [x for x in (ds[i] for i in range(len(ds))) if x is not None]
  except records.EmptyDataset:  # an iteration with no samples at all (committed, empty)
    pairs = []
  for ep, prov in pairs:
    if prov["source"] != SOURCE or int(prov["extra"]["iteration"]) != iteration:
      raise ValueError(f"{samples_dir}: sample {ep.task}/{ep.seed} is from {prov['source']!r} iteration "
                       f"{prov['extra'].get('iteration')}, expected {SOURCE!r} iteration {iteration}")
  eps = [ep for ep, _ in pairs]
  sft, ct, counts = route(eps, [int(p["extra"]["v"]) for _, p in pairs], iteration)
  counts.corrupt = counter.count
  meta = records.load_meta(samples_dir)
  pfx = prefix(iteration)
  for name, idx in (("sft", sft), ("ct", ct)):
    d = set_dirs(root)[name]
    if not idx or records.prefix_committed(d, pfx):
      continue
    with records.RecordWriter(d, meta, prefix=pfx) as w:
      for i in idx:
        ep, prov = pairs[i]
        w.write(ep, source=SOURCE, policy_version=int(prov["policy_version"]), extra=prov["extra"])
  return counts


def set_dirs(root: str) -> dict[str, str]:
  """{"sft": <root>/data/sft, "ct": <root>/data/ct}."""
  return {name: os.path.join(root, "data", name) for name in SETS}


def dataset_size(dirs: str | Sequence[str], upto_iteration: int | None = None) -> int:
  """Records committed in one or several dataset dirs (dataset.json shard counts; a dir without one: 0).
  `upto_iteration`: only the shards of prefixes `prefix(t)` with t <= upto_iteration, plus every shard of
  another prefix (the base sets), i.e. a flywheel set's size as it was after iteration `upto_iteration`."""
  dirs = [dirs] if isinstance(dirs, (str, os.PathLike)) else list(dirs)
  n = 0
  for d in dirs:
    if not os.path.exists(os.path.join(d, records.INDEX_FILE)):
      continue
    for s in records.read_index(d)["shards"]:
      m = _PREFIX.match(s["file"])
      if upto_iteration is None or m is None or int(m.group(1)) <= upto_iteration:
        n += int(s["records"])
  return n

