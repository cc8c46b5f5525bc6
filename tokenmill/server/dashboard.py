"""The live dashboard: a per-second timeline of the engine's own statistics, and the page that plots it.

The timeline is fed where the Prometheus metrics are (ServerMetrics.on_step, on the engine thread) and
read by GET /dashboard/stats, which the page (dashboard.html, no external scripts) polls once a second.
Reading it costs the engine nothing: the page asks only for the seconds it has not seen yet.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from importlib import resources

WINDOW_SECONDS = 300  # history kept, and shown on a fresh page
PERCENTILE_SPAN = 5  # seconds of samples behind each point's latency percentiles
MAX_SAMPLES = 4096  # latency samples kept per second (the rest are dropped, evenly)


@dataclass(slots=True)
class _Second:
    t: int
    tokens: int = 0
    finished: int = 0
    ttft: list = field(default_factory=list)
    itl: list = field(default_factory=list)
    itl_seen: int = 0
    gauges: dict | None = None  # the engine's stats at the latest step of this second


def percentiles(values: list[float]) -> dict | None:
    """p50, p90 and p99 (nearest rank) in milliseconds, or None for no samples."""
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)

    def rank(q):
        return round(ordered[min(n - 1, max(0, math.ceil(q * n) - 1))] * 1000, 3)

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99)}


class Timeline:
    """What happened in each of the last WINDOW_SECONDS seconds. Written on the engine thread, read on the
    server's; a lock keeps the two apart (held for microseconds on the engine's side)."""

    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self._seconds: deque[_Second] = deque()
        self._lock = threading.Lock()
        self.stats_source = None  # engine.stats, once the engine is up
        self._last_gauges = 0.0
        self.started = clock()

    def _second(self, now: float) -> _Second:
        """The bucket of `now`'s second. A time a little behind the newest bucket (the engine thread's
        clock read just before the server's, or the clock stepped back) goes into the newest one."""
        t = int(now)
        if not self._seconds or self._seconds[-1].t < t:
            self._seconds.append(_Second(t))
            while self._seconds and self._seconds[0].t <= t - WINDOW_SECONDS:
                self._seconds.popleft()
            return self._seconds[-1]
        return next((s for s in reversed(self._seconds) if s.t == t), self._seconds[-1])

    def record(self, now: float, tokens: int = 0, ttft: list[float] = (), itl: list[float] = (),
               finished: int = 0) -> None:
        """One engine step's worth: new tokens, first-token latencies, gaps between tokens, finishes."""
        gauges = None
        if self.stats_source is not None and (finished or now - self._last_gauges >= 0.25):
            self._last_gauges = now
            gauges = self.stats_source()
        with self._lock:
            s = self._second(now)
            s.tokens += tokens
            s.finished += finished
            s.ttft.extend(ttft)
            for gap in itl:  # past MAX_SAMPLES, newer gaps overwrite older ones in turn
                if len(s.itl) < MAX_SAMPLES:
                    s.itl.append(gap)
                else:
                    s.itl[s.itl_seen % MAX_SAMPLES] = gap
                s.itl_seen += 1
            if gauges is not None:
                s.gauges = dict(gauges)

    def snapshot(self, since: int | None = None, now: float | None = None) -> dict:
        """Per-second points after `since` (all kept ones if None), up to the last complete second."""
        now = self.clock() if now is None else now
        self.record(now)  # idle seconds get the engine's gauges too, while someone watches
        gauges = self.stats_source() if self.stats_source is not None else None
        with self._lock:
            seconds = list(self._seconds)
        last = int(now) - 1  # the current second is still filling
        first = max(last - WINDOW_SECONDS + 1, int(self.started))
        if since is not None:
            first = max(first, since + 1)
        by_t = {s.t: s for s in seconds}
        points = []
        carried = None
        for s in seconds:  # gauges before the first point carry into it
            if s.t < first and s.gauges is not None:
                carried = s.gauges
        hits_prev = None
        for t in range(first - 1, last + 1):
            s = by_t.get(t)
            if s is not None and s.gauges is not None:
                carried = s.gauges
            if t < first:
                hits_prev = carried
                continue
            span = [by_t[u] for u in range(t - PERCENTILE_SPAN + 1, t + 1) if u in by_t]
            point = {"t": t, "tokens_per_s": s.tokens if s else 0, "finished": s.finished if s else 0,
                     "ttft_ms": percentiles([v for x in span for v in x.ttft]),
                     "itl_ms": percentiles([v for x in span for v in x.itl])}
            if carried is not None:
                point.update(running=carried["num_requests_running"], waiting=carried["num_requests_waiting"],
                             kv_cache_usage=round(carried["kv_cache_usage_perc"], 4))
                point["prefix_cache_hit_rate"] = _hit_rate(hits_prev, carried)
            hits_prev = carried
            points.append(point)
        return {"now": now, "points": points, "gauges": gauges}


def _hit_rate(before: dict | None, after: dict) -> float | None:
    """Share of the prompt tokens looked up in this interval that were found in the prefix cache."""
    base = before or {"prefix_cache_queries": 0, "prefix_cache_hits": 0}
    queries = after["prefix_cache_queries"] - base["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - base["prefix_cache_hits"]
    return round(hits / queries, 4) if queries > 0 else None


def page() -> str:
    return resources.files("tokenmill.server").joinpath("dashboard.html").read_text(encoding="utf-8")
