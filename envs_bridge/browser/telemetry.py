"""Event log and Prometheus metrics of a browser sandbox (issue #5 item 1).

`EventLog`: a bounded, numbered log of browser/page/session events (launch, crash, restart, page
created/reused/crashed/hung, session opened/closed/expired/lost, GC). Served by `GET /events`.

`SandboxMetrics`: counters, gauges and latency histograms in their own `prometheus_client`
registry (one per sandbox, so several sandboxes can live in one process), rendered in the
Prometheus text format by `GET /metrics`. Steps/s: the counter `sandbox_steps_total` (use
`rate()`), and the gauge `sandbox_steps_per_second` over the last `window_s` seconds for readers
without a Prometheus server.
"""

from __future__ import annotations

import collections
import itertools
import time

import prometheus_client as prom

# Latency buckets (seconds): a step on 2 busy cores is ~10-100 ms; opens and recoveries take seconds.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OPS = ("open", "step", "observe", "close", "snapshot", "restore")


class EventLog:
  """The last `maxlen` events, each {seq, t (unix s), kind, **fields}; seq grows from 1."""

  def __init__(self, maxlen: int = 10_000):
    self._events: collections.deque[dict] = collections.deque(maxlen=maxlen)
    self._seq = itertools.count(1)

  def add(self, kind: str, **fields) -> dict:
    ev = {"seq": next(self._seq), "t": round(time.time(), 6), "kind": kind, **fields}
    self._events.append(ev)
    return ev

  def since(self, seq: int = 0, limit: int = 1000) -> list[dict]:
    """Events with seq > `seq`, oldest first, at most `limit`."""
    return [e for e in self._events if e["seq"] > seq][:limit]

  def kinds(self) -> list[str]:
    return [e["kind"] for e in self._events]


class SandboxMetrics:
  """Prometheus metrics of one sandbox (names prefixed `sandbox_`)."""

  def __init__(self, window_s: float = 10.0):
    self.registry = r = prom.CollectorRegistry()
    self.sessions = prom.Gauge("sandbox_sessions", "open sessions", registry=r)
    self.pages = prom.Gauge("sandbox_pages", "browser contexts (one page each) alive, idle ones included",
                            ["browser"], registry=r)
    self.browsers_up = prom.Gauge("sandbox_browsers_up", "connected Chromium processes", registry=r)
    self.steps = prom.Counter("sandbox_steps", "environment steps executed", registry=r)
    self.steps_per_s = prom.Gauge("sandbox_steps_per_second", f"steps/s over the last {window_s:g} s", registry=r)
    self.events = prom.Counter("sandbox_session_events", "session life-cycle events", ["event"], registry=r)
    self.lost = prom.Counter("sandbox_sessions_lost", "sessions lost, by cause", ["cause"], registry=r)
    self.browser_crashes = prom.Counter("sandbox_browser_crashes", "Chromium processes that died", registry=r)
    self.page_crashes = prom.Counter("sandbox_page_crashes", "renderer crashes of a page", registry=r)
    self.page_hangs = prom.Counter("sandbox_page_hangs", "pages that did not answer in time", registry=r)
    self.recoveries = prom.Counter("sandbox_recoveries", "Chromium relaunches after a crash", registry=r)
    self.recovery_s = prom.Histogram("sandbox_recovery_seconds", "crash detected -> new Chromium ready",
                                     buckets=_BUCKETS, registry=r)
    self.gc_closed = prom.Counter("sandbox_gc_closed_pages", "leaked pages closed by the GC", registry=r)
    self.latency = prom.Histogram("sandbox_op_seconds", "latency of sandbox calls", ["op"], buckets=_BUCKETS,
                                  registry=r)
    self._op = {op: self.latency.labels(op) for op in OPS}  # resolved once: observe() is on the step path
    self._window_s = window_s
    self._samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)
    self._steps_total = 0

  def op(self, name: str):
    """The latency histogram child of one op (`.observe(seconds)`, `.time()`)."""
    return self._op[name]

  def count_step(self) -> None:
    self.steps.inc()
    self._steps_total += 1

  def sample(self) -> None:
    """Records (now, steps so far); called periodically and before every scrape."""
    now = time.monotonic()
    self._samples.append((now, self._steps_total))
    while len(self._samples) > 1 and now - self._samples[1][0] >= self._window_s:
      self._samples.popleft()  # keep one sample at least window_s old
    t0, n0 = self._samples[0]
    self.steps_per_s.set((self._steps_total - n0) / (now - t0) if now > t0 else 0.0)

  def render(self) -> bytes:
    self.sample()
    return prom.generate_latest(self.registry)


CONTENT_TYPE = prom.CONTENT_TYPE_LATEST
