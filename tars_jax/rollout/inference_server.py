"""Policy inference for rollouts: a lockstep batch call and a continuous-batching service.

`BatchedPolicy` (synchronous rollouts, `rollout.streaming=False`): turns a list of prompts (token
ids + the screenshots of their turns) into one left-padded batch of fixed shape, runs the KV-cache
sampler with grammar-constrained decoding to the batch's last EOS, and splits the replies.

`InferenceService` (streaming rollouts, `rollout/pool.py`): requests join and leave a running batch
of KV-cache slots between decode steps, weights swap between steps with a version number
(report section 2.5.3, asynchronous inference).

Shapes are bucketed (batch to `batch_size` / slots, prompt length to a multiple of
`length_multiple`) so jit compiles a handful of programs per run.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tars_jax.agent.grammar import Grammar
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import bucket, pow2_bucket
from tars_jax.models.inference import quant
from tars_jax.models.inference import sampler
from tars_jax.models.inference import slot_decode


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
    max_images: image slots per row at most (= max turns of an episode); a call uses the fewest
      (powers of two) its prompts need.
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
  # serving weights: None (as given), or a `quant.MODES` name ("int8" = W8A8, "int4" = W4A8, ...):
  # `params` are quantised once per new params object (`quant.Quantizer`). Raises QuantizationError.
  quantize: str | None = None

  def __post_init__(self):
    self._table = None if self.grammar is None else jnp.asarray(self.grammar.table)
    self._quantizer = quant.Quantizer(self.graphdef, self.quantize)
    self._served_for, self._served = None, None
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

  def _serving(self):
    """(graphdef, params) to sample with: `params` quantised by `quantize`, redone when `params` is
    replaced (the trainer assigns a new pytree after each update)."""
    if self._served_for is not self.params:
      self._served, self._served_for = self._quantizer.quantize(self.params), self.params
    return self._served

  def _act_chunk(self, prompts, images):
    # Rows and image slots shrink to the chunk's needs (powers of two): after the first turns of a
    # lockstep round most episodes have ended, and a turn-k prompt holds k screenshots, not max_images.
    n = len(prompts)
    b = pow2_bucket(n, min(8, self.batch_size), self.batch_size)
    slots = pow2_bucket(max(1, max(len(x) for x in images)), 1, self.max_images)
    p = bucket(max(len(x) for x in prompts), self.length_multiple)
    h, w = self.image_hw
    tokens = np.full((b, p), self.tokenizer.pad_id, np.int32)
    mask = np.zeros((b, p), bool)
    pix = np.zeros((b, slots, h, w, 3), np.float32)
    img_mask = np.zeros((b, slots), bool)
    for i in range(b):
      ids = prompts[i] if i < n else [self.tokenizer.bos_id]  # filler rows: one BOS token
      tokens[i, p - len(ids):], mask[i, p - len(ids):] = ids, True  # left padding
      for m, im in enumerate(images[i] if i < n else []):
        pix[i, m] = im.astype(np.float32) / 255.0
        img_mask[i, m] = True
    self._key, key = jax.random.split(self._key)
    start = None if self.grammar is None else jnp.full((b,), self.grammar.start, jnp.int32)
    gen = sampler.generate(
        *self._serving(), jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(pix),
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


# The smallest span a decode step attends over (`InferenceService._span`): spans are 256 * 2**k, so a
# service compiles a handful of step programs.
SPAN_FLOOR = 256


class ContextTooLong(ValueError):
  """A request that cannot fit a slot: prompt (bucketed) + max new tokens + one chunk > cache length."""

  def __init__(self, prompt_tokens: int, max_new_tokens: int, capacity: int):
    self.prompt_tokens, self.max_new_tokens, self.capacity = prompt_tokens, max_new_tokens, capacity
    super().__init__(f"request of {prompt_tokens} prompt tokens (bucketed) + {max_new_tokens} new tokens does "
                     f"not fit the service's {capacity}-slot KV cache (context_len)")


class ServiceBusy(RuntimeError):
  """The service's queue of requests not yet admitted holds `max_pending` already: `submit` refuses the
  request instead of queueing without bound (asyncio callers of `generate` wait for room instead)."""

  def __init__(self, pending: int, max_pending: int):
    self.pending, self.max_pending = pending, max_pending
    super().__init__(f"inference service busy: {pending} requests queued (max_pending={max_pending})")


@dataclasses.dataclass
class Reply:
  """One generated reply. tokens: ids up to and including EOS; logprobs [n] float32 behaviour
  log-probs (the constrained, temperature-scaled distribution, as `sampler.generate`); states [n]
  int32 grammar state before each token (-1 without grammar); versions [n] int32 policy version
  that produced each token (weights change only between decode steps)."""
  tokens: list[int]
  logprobs: np.ndarray
  states: np.ndarray
  versions: np.ndarray
  request_id: int = 0


@dataclasses.dataclass
class ServiceStats:
  """Counters since start: decode steps, mean fraction of slots busy per step, requests finished,
  prefill calls, generated tokens, weight swaps."""
  steps: int = 0
  busy_slot_steps: int = 0
  slots: int = 1
  requests: int = 0
  prefills: int = 0
  extends: int = 0  # multi-turn KV reuse: groups of next-turn prompts run into their sessions' slots
  reused: int = 0  # requests that continued their session's context (only their new tokens were run)
  tokens: int = 0
  swaps: int = 0

  @property
  def occupancy(self) -> float:
    return self.busy_slot_steps / max(1, self.steps * self.slots)


class _Request:
  def __init__(self, rid, ids, images, key, budget, session=None):
    self.rid, self.ids, self.images, self.key, self.budget = rid, ids, images, key, budget
    self.session = session
    self.kv_version = -1  # the weight version its context's keys / values were computed with
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self.states: list[int] = []
    self.versions: list[int] = []


class InferenceService:
  """Continuous-batching policy inference (report section 2.5.3: the policy served asynchronously).

  Many callers (episodes) submit requests at any time; a decode thread admits them into free KV-cache
  slots between decode steps (`models/inference/slot_decode.py`: prefill, insert, step), so a request joins
  the running batch as soon as a slot frees and leaves it at its EOS, without waiting for the
  other rows. `set_params(params, version)` swaps the weights between two decode steps: every token
  records a version (`Reply.versions`: the oldest weights its logits depend on), and no token's
  logits mix two weight versions in one layer.

  APIs (the same for `act`'s lockstep callers and for streaming ones): `submit` (thread-safe,
  returns a `concurrent.futures.Future[Reply]`), `await generate(...)` (asyncio), and
  `act(prompts, images)` (the `agent_loop.ActFn` of `BatchedPolicy`). Use as a context manager or
  call `close()`: the decode thread stops and pending requests fail with RuntimeError. The queue of
  requests waiting for a slot is bounded (`max_pending`): `submit` beyond it raises ServiceBusy,
  `generate` waits until the decode thread admits some.

  Multi-turn KV reuse: requests that name a `session` (one episode) keep their slot after the reply,
  holding the keys / values of prompt + reply; the episode's next prompt, if it extends that context,
  runs only its new tokens into the slot (`slot_decode.extend`) instead of the whole history with
  every earlier screenshot. `release(session)` frees the slot (the episode ended); idle sessions are
  evicted least recently used when a new request needs a slot, and all of them at a weight swap (a
  new turn never reads keys / values of older weights). Tokens of a request in flight across a swap
  are computed by the new weights over its context's keys / values from the old ones (partial
  rollouts without recomputation); each token carries the oldest version its logits depend on, the
  context's, so staleness rules and the decoupled objective's behaviour policy never count such a
  token as newer than it is.

  Shapes: `slots` rows of `context_len` cache positions; prompts are left-padded to a multiple of
  `length_multiple` and prefilled in groups of a power-of-two size. A decode step (and an extend)
  attends over the first `span` positions of the slots, 256 * 2**k covering the longest context any
  slot holds (a request's or an idle session's, `_span`), not over all `context_len`: a step streams
  every slot's keys and values, so its cost follows the contexts held, not the capacity. jit compiles
  one step program per span and a handful of prefill / insert / extend programs. Single device.
  """

  def __init__(self, graphdef, params, *, tokenizer: ByteTokenizer, grammar: Grammar | None, slots: int,
               context_len: int, max_images: int, image_hw: tuple[int, int], max_new_tokens: int,
               temperature: float = 1.0, top_p: float = 1.0, length_multiple: int = 64,
               jump_forward: int = 1, seed: int = 0, version: int = 0, quantize: str | None = None,
               max_pending: int = 4096):
    if slots < 1 or jump_forward < 1 or max_pending < 1:
      raise ValueError(f"slots, jump_forward and max_pending must be >= 1, got {slots}, {jump_forward}, {max_pending}")
    self.max_pending = max_pending
    self.graphdef, self.tokenizer, self.grammar = graphdef, tokenizer, grammar
    self.n_slots, self.context_len, self.max_images, self.image_hw = slots, context_len, max_images, image_hw
    self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
    self.length_multiple, self.seed = length_multiple, seed
    self.chunk = jump_forward if grammar is not None else 1
    self._table = None if grammar is None else jnp.asarray(grammar.table)
    # the service's own copy: a trainer's update donates its parameter buffers
    self._params, self._version = jax.tree.map(jnp.copy, params), version
    # structure, shapes and dtypes of the (float) params `set_params` takes, before any quantisation
    self.param_template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    # serving weights: None (as given) or a `quant.MODES` name ("int8" = W8A8, "int4" = W4A8, ...),
    # quantised once per weight version; raises QuantizationError for an unknown mode
    self._quantizer = quant.Quantizer(graphdef, quantize)
    graphdef, params = self._quantizer.quantize(self._params)
    self.graphdef, self._params = graphdef, params
    self._decode_weights = slot_decode.prepare_decode_weights(graphdef, params)
    self._swap = None
    self._slots = slot_decode.init_slots(nnx.merge(graphdef, params), slots, context_len)
    self._owner: list[_Request | None] = [None] * slots
    self._cursor = [0] * slots  # next cache position of each slot (host copy of `Slots.cur`)
    # sessions (multi-turn KV reuse), touched by the decode thread only: session -> (slot, context
    # ids in the slot, screenshots in them, last use); slot -> session it holds while idle
    self._sessions: dict = {}
    self._pinned: list = [None] * slots
    self._releases: collections.deque = collections.deque()  # from `release`, applied by the decode thread
    self._released_in_flight: set = set()
    self._use = 0
    self._pending: collections.deque[_Request] = collections.deque()
    self._cv = threading.Condition()
    self._closed = False
    self._next_id = 0
    self.stats = ServiceStats(slots=slots)
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="inference-service", daemon=True)
    self._thread.start()

  # ---- client side -------------------------------------------------------------------------------
  @property
  def version(self) -> int:
    """The weight version of the next decode step (after a pending swap, the new one)."""
    with self._cv:
      return self._swap[1] if self._swap is not None else self._version

  def submit(self, prompt_ids: list[int], images: list[np.ndarray], key=None,
             max_new_tokens: int | None = None, session=None) -> concurrent.futures.Future:
    """Queues one request; thread-safe. images: the [H, W, 3] uint8 screenshots of its IMAGE blocks,
    in order. key: [2] uint32 PRNG key of its samples (default fold_in(PRNGKey(seed), request id)).
    session: any hashable naming the episode (multi-turn KV reuse, class docstring), or None.

    Raises: ContextTooLong (prompt bucket + max new tokens + chunk > context_len); ValueError (more
    images than max_images); ServiceBusy (`max_pending` requests queued); RuntimeError (service closed
    or its decode thread failed).
    """
    budget = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    p = bucket(len(prompt_ids), self.length_multiple)
    if p + budget + self.chunk > self.context_len:
      raise ContextTooLong(p, budget, self.context_len)
    if len(images) > self.max_images:
      raise ValueError(f"{len(images)} images > max_images {self.max_images}")
    with self._cv:
      if self._closed or self._error is not None:
        raise RuntimeError("inference service is closed") from self._error
      if len(self._pending) >= self.max_pending:
        raise ServiceBusy(len(self._pending), self.max_pending)
      rid = self._next_id
      self._next_id += 1
      if key is None:
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), rid)
      req = _Request(rid, list(prompt_ids), list(images), np.asarray(key, np.uint32), budget, session)
      self._pending.append(req)
      self._cv.notify()
    return req.future

  async def generate(self, prompt_ids: list[int], images: list[np.ndarray], key=None,
                     max_new_tokens: int | None = None, session=None) -> Reply:
    """`submit` for asyncio callers: awaits the `Reply` without blocking the event loop; while the
    queue is full (ServiceBusy) it waits for the decode thread to admit requests (polling every 5 ms:
    the queue drains at every decode step, or submit raises once the service has failed)."""
    while True:
      try:
        fut = self.submit(prompt_ids, images, key, max_new_tokens, session)
        break
      except ServiceBusy:
        await asyncio.sleep(0.005)
    return await asyncio.wrap_future(fut)

  def release(self, session) -> None:
    """The episode `session` ended: its slot's context is dropped (thread-safe; unknown: no-op)."""
    with self._cv:
      self._releases.append(session)
      self._cv.notify()

  def act(self, prompts: list[list[int]], images: list[list[np.ndarray]]
          ) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """`agent_loop.ActFn`: submits every prompt, waits for all; (ids, logprobs [n], states [n]) each."""
    futs = [self.submit(p, im) for p, im in zip(prompts, images)]
    return [(r.tokens, r.logprobs, r.states) for r in (f.result() for f in futs)]

  def set_params(self, params, version: int) -> None:
    """Serves `params` as `version` from the next decode step on (requests in flight continue with
    them over the keys / values of their context: their tokens keep the version of that context).
    The service keeps a copy: the caller may donate or change `params` afterwards."""
    params = jax.tree.map(jnp.copy, params)
    params = self._quantizer.quantize(params)[1]  # `quantize` mode: its serving weights
    with self._cv:
      self._swap = (params, int(version))
      self._cv.notify()

  def close(self) -> None:
    """Stops the decode thread; requests not finished fail with RuntimeError."""
    with self._cv:
      self._closed = True
      self._cv.notify()
    self._thread.join()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ---- decode thread -----------------------------------------------------------------------------
  def _run(self):
    try:
      while True:
        with self._cv:
          while (not self._closed and not self._pending and not any(self._owner) and self._swap is None
                 and not self._releases):
            self._cv.wait()
          if self._closed:
            break
          if self._swap is not None:  # between two decode steps: never inside one
            self._params, self._version = self._swap
            self._swap = None
            self._decode_weights = slot_decode.prepare_decode_weights(self.graphdef, self._params)
            self.stats.swaps += 1
            for sess in [x for x in self._pinned if x is not None]:  # idle contexts of older weights
              self._drop_session(sess)
          while self._releases:
            self._drop_session(self._releases.popleft())
          fresh, extend = self._plan()
        self._admit(fresh)
        self._extend(extend)
        if any(self._owner):
          self._step()
    except BaseException as e:  # fail every waiter instead of hanging them
      logging.exception("inference service decode thread failed")
      self._error = e
    err = self._error or RuntimeError("inference service closed")
    with self._cv:
      waiting = [o for o in self._owner if o is not None] + list(self._pending)
      self._pending.clear()
    for r in waiting:
      if not r.future.done():
        r.future.set_exception(err)

  def _drop_session(self, session) -> None:
    entry = self._sessions.pop(session, None)
    if entry is None:
      if any(o is not None and o.session == session for o in self._owner):
        self._released_in_flight.add(session)  # not pinned when its reply finishes
      return
    if self._pinned[entry[0]] == session:
      self._pinned[entry[0]] = None

  def _plan(self) -> tuple[list[tuple[_Request, int]], list[tuple[_Request, int, int, int]]]:
    """Places pending requests (FIFO) in slots: (fresh: [(request, slot)], extend: [(request, slot,
    context tokens already in the slot, screenshots among them)]). A request that continues its
    session's idle context (its ids start with them, the slot has room) extends it; otherwise it
    takes a free slot, or evicts the least recently used idle session. Stops at the first request
    with no slot (order kept)."""
    fresh, extend = [], []
    taken = set()
    while self._pending:
      r = self._pending[0]
      entry = self._sessions.get(r.session) if r.session is not None else None
      if entry is not None:
        s, ctx, n_img, _ = entry
        new = len(r.ids) - len(ctx)
        fits = self._cursor[s] + bucket(max(new, 1), self.length_multiple) + r.budget + self.chunk <= self.context_len
        if (self._owner[s] is None and new > 0 and r.ids[:len(ctx)] == ctx and len(r.images) >= n_img and fits
            and s not in taken):
          self._pending.popleft()
          self._sessions.pop(r.session)
          self._pinned[s] = None
          taken.add(s)
          extend.append((r, s, len(ctx), n_img))
          continue
        self._drop_session(r.session)  # the context was rebuilt (memory) or is full: start over
      free = [s for s in range(self.n_slots) if self._owner[s] is None and self._pinned[s] is None and s not in taken]
      if not free:
        idle = [s for s in range(self.n_slots) if self._owner[s] is None and self._pinned[s] is not None
                and s not in taken]
        if not idle:
          break
        victim = min(idle, key=lambda s: self._sessions[self._pinned[s]][3])
        self._drop_session(self._pinned[victim])
        free = [victim]
      self._pending.popleft()
      taken.add(free[0])
      fresh.append((r, free[0]))
    return fresh, extend

  def _span(self) -> int:
    """Cache positions a step or an extend attends over: 256 * 2**k (at most `context_len`) covering
    every slot that holds a request or an idle session, cursor + one decode chunk (the positions past
    it are neither read nor written: `slot_decode.step`)."""
    held = [self._cursor[s] + self.chunk for s in range(self.n_slots)
            if self._owner[s] is not None or self._pinned[s] is not None]
    return pow2_bucket(max(held, default=0), SPAN_FLOOR, self.context_len)

  def _extend(self, plan) -> None:
    groups: dict[int, list] = {}
    for r, s, n_ctx, n_img in plan:
      if r.future.set_running_or_notify_cancel():
        groups.setdefault(bucket(len(r.ids) - n_ctx, self.length_multiple), []).append((r, s, n_ctx, n_img))
    h, w = self.image_hw
    for p, group in sorted(groups.items()):
      n = 1 << (len(group) - 1).bit_length()
      tokens = np.full((n, p), self.tokenizer.pad_id, np.int32)
      mask = np.zeros((n, p), bool)
      pix = np.zeros((n, self.max_images, h, w, 3), np.float32)
      img_mask = np.zeros((n, self.max_images), bool)
      idx = np.full((n,), self.n_slots, np.int32)
      keys = np.zeros((n, 2), np.uint32)
      start = np.full((n,), -1 if self.grammar is None else self.grammar.start, np.int32)
      budget = np.zeros((n,), np.int32)
      tokens[:, -1], mask[:, -1] = self.tokenizer.bos_id, True  # filler rows: one token
      for j, (r, s, n_ctx, n_img) in enumerate(group):
        ids = r.ids[n_ctx:]
        tokens[j], mask[j] = self.tokenizer.pad_id, False
        tokens[j, p - len(ids):], mask[j, p - len(ids):] = ids, True
        for m, im in enumerate(r.images[n_img:]):
          pix[j, m], img_mask[j, m] = im.astype(np.float32) / 255.0, True
        idx[j], keys[j], budget[j] = s, r.key, r.budget
        self._owner[s], r.kv_version = r, self._version
        self._cursor[s] += p
        self.stats.reused += 1
      self._slots = slot_decode.extend(self.graphdef, self._params, self._slots, jnp.asarray(tokens),
                                       jnp.asarray(mask), jnp.asarray(pix), jnp.asarray(img_mask), idx, keys,
                                       start, budget, span=self._span())
      self.stats.extends += 1

  def _admit(self, plan: list[tuple[_Request, int]]):
    groups: dict[int, list[tuple[_Request, int]]] = {}
    for r, s in plan:
      if r.future.set_running_or_notify_cancel():
        groups.setdefault(bucket(len(r.ids), self.length_multiple), []).append((r, s))
    h, w = self.image_hw
    for p, group in sorted(groups.items()):
      n = 1 << (len(group) - 1).bit_length()  # power-of-two group sizes: few prefill programs
      tokens = np.full((n, p), self.tokenizer.pad_id, np.int32)
      mask = np.zeros((n, p), bool)
      pix = np.zeros((n, self.max_images, h, w, 3), np.float32)
      img_mask = np.zeros((n, self.max_images), bool)
      idx = np.full((n,), self.n_slots, np.int32)  # filler rows: dropped by insert
      keys = np.zeros((n, 2), np.uint32)
      start = np.full((n,), -1 if self.grammar is None else self.grammar.start, np.int32)
      budget = np.zeros((n,), np.int32)
      for j in range(n):
        r, s = group[j] if j < len(group) else (None, None)
        ids = r.ids if r is not None else [self.tokenizer.bos_id]
        tokens[j, p - len(ids):], mask[j, p - len(ids):] = ids, True  # left padding
        if r is None:
          continue
        for m, im in enumerate(r.images):
          pix[j, m], img_mask[j, m] = im.astype(np.float32) / 255.0, True
        idx[j], keys[j], budget[j] = s, r.key, r.budget
        self._owner[s], r.kv_version, self._cursor[s] = r, self._version, p
      pre = slot_decode.prefill(self.graphdef, self._params, jnp.asarray(tokens), jnp.asarray(mask),
                                jnp.asarray(pix), jnp.asarray(img_mask))
      self._slots = slot_decode.insert(self._slots, pre, idx, keys, start, budget)
      self.stats.prefills += 1

  def _step(self):
    busy = [s for s, o in enumerate(self._owner) if o is not None]
    cancelled = [s for s in busy if self._owner[s].future.cancelled()]
    if cancelled:
      self._slots = slot_decode.release(self._slots, cancelled)
    self._slots, chunk = slot_decode.step(
        self.graphdef, self._params, self._decode_weights, self._slots, self._table,
        temperature=self.temperature, top_p=self.top_p, eos_id=self.tokenizer.eos_id,
        pad_id=self.tokenizer.pad_id, chunk=self.chunk, span=self._span())
    toks, lps, sts, lens, active = jax.device_get(chunk)
    self.stats.steps += 1
    self.stats.busy_slot_steps += len(busy)
    for s in busy:
      r, k = self._owner[s], int(lens[s])
      r.tokens += toks[s, :k].tolist()
      r.logprobs += lps[s, :k].tolist()
      r.states += sts[s, :k].tolist()
      r.versions += [min(self._version, r.kv_version)] * k  # the oldest weights its logits depend on
      self._cursor[s] += k
      self.stats.tokens += k
      if not active[s]:
        self._owner[s] = None
        if r.session is not None:
          if r.session in self._released_in_flight:
            self._released_in_flight.discard(r.session)
          elif r.kv_version == self._version and not r.future.cancelled():  # context of current weights only
            self._use += 1
            self._sessions[r.session] = (s, r.ids + r.tokens, len(r.images), self._use)
            self._pinned[s] = r.session
        if r.future.cancelled():
          continue
        self.stats.requests += 1
        st = np.asarray(r.states, np.int32) if self.grammar is not None else np.full(len(r.tokens), -1, np.int32)
        r.future.set_result(Reply(r.tokens, np.asarray(r.logprobs, np.float32), st,
                                  np.asarray(r.versions, np.int32), r.rid))
