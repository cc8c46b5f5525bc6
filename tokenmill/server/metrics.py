"""Prometheus metrics, named as vLLM users know them with a tokenmill: prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.outputs import RequestOutput
from tokenmill.server.dashboard import Timeline

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(f"tokenmill:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc, extra=()):
            c = Counter(f"tokenmill:{name}", doc, labels + list(extra), registry=r)
            return c if extra else c.labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"tokenmill:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.model_name = model_name
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished and running requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.preemptions = counter("num_preemptions", "Requests preempted (blocks freed, recomputed later).")
        self.rejected = counter("requests_rejected", "Requests refused because the queue was full.")
        self.refused_connections = counter("connections_refused", "Connections refused at --max-connections, "
                                           "or closed because their request headers did not arrive in time.",
                                           ["reason"])
        self.closed_idle_connections = counter("connections_closed_idle", "Kept-alive connections, idle between "
                                               "requests, closed at --max-connections to admit a new one.")
        self.aborted = counter("requests_aborted", "Requests aborted (client gone, shutdown or error).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec = {
            "spec_decode_num_drafts": counter("spec_decode_num_drafts", "Speculative verification passes of a "
                                              "request with proposed tokens."),
            "spec_decode_num_draft_tokens": counter("spec_decode_num_draft_tokens", "Proposed tokens verified."),
            "spec_decode_num_accepted_tokens": counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted."),
        }
        self.spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, by their "
                                    "position in the proposal (0: the first).", ["position"])
        self._spec_per_pos: list[int] = []
        # The CPU's team of threads on one thread while another process holds one of its cores.
        self.one_thread = {
            "cpu_steps_on_one_thread": counter("cpu_steps_on_one_thread", "Engine steps run on one thread "
                                               "because another process held one of the team's cores."),
            "cpu_one_thread_holds": counter("cpu_one_thread_holds", "Times the engine's steps went to one "
                                            "thread for a while (another process held a core)."),
            "cpu_decode_calls_on_one_thread": counter("cpu_decode_calls_on_one_thread", "Fused decode calls "
                                                      "run on one thread after the team lagged behind a busy core."),
        }
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.", _E2E_BUCKETS)
        self.timeline = Timeline()  # the dashboard's per-second view of the same events
        self._seen_tokens: dict[str, tuple[int, float]] = {}
        self._engine_counts = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                               **dict.fromkeys(self.spec, 0), **dict.fromkeys(self.one_thread, 0)}

    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        """Called on the engine thread after each step with the outputs it produced."""
        new_tokens, finished, ttfts, gaps = 0, 0, [], []
        for out in outputs:
            ntok = sum(len(c.token_ids) for c in out.outputs)
            prev, last_time = self._seen_tokens.get(out.request_id, (0, None))
            if prev == 0 and ntok > 0:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                if out.metrics.first_token_time is not None:
                    ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
                    self.ttft.observe(ttfts[-1])
                if out.metrics.first_scheduled_time is not None:
                    self.queue_time.observe(out.metrics.first_scheduled_time - out.metrics.arrival_time)
            elif ntok > prev and last_time is not None:
                gap = (now - last_time) / (ntok - prev)
                for _ in range(ntok - prev):
                    self.itl.observe(gap)
                gaps.extend([gap] * (ntok - prev))
            if ntok > prev:
                self.generation_tokens.inc(ntok - prev)
                new_tokens += ntok - prev
            if out.finished:
                finished += 1
                self._seen_tokens.pop(out.request_id, None)
                self.e2e.observe(now - out.metrics.arrival_time)
                for c in out.outputs:
                    if c.finish_reason == "abort":
                        self.aborted.inc()
                    else:
                        self.success.labels(self.model_name, c.finish_reason).inc()
            else:
                self._seen_tokens[out.request_id] = (ntok, now)
        self.timeline.record(now, new_tokens, ttfts, gaps, finished)

    def refresh(self, stats: dict) -> None:
        """Copy the engine's gauges and counters (read at scrape time)."""
        self.running.set(stats["num_requests_running"])
        self.waiting.set(stats["num_requests_waiting"])
        self.kv_usage.set(stats["kv_cache_usage_perc"])
        counters = [("num_preemptions", self.preemptions), ("prefix_cache_queries", self.prefix_queries),
                    ("prefix_cache_hits", self.prefix_hits)]
        if "spec_decode_num_drafts" in stats:
            counters += list(self.spec.items())
            per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
            self._spec_per_pos += [0] * (len(per_pos) - len(self._spec_per_pos))
            for i, n in enumerate(per_pos):
                if n > self._spec_per_pos[i]:
                    self.spec_per_pos.labels(self.model_name, str(i)).inc(n - self._spec_per_pos[i])
                    self._spec_per_pos[i] = n
        counters += [(key, metric) for key, metric in self.one_thread.items() if key in stats]
        for key, metric in counters:
            delta = stats[key] - self._engine_counts[key]
            if delta > 0:
                metric.inc(delta)
            self._engine_counts[key] = stats[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)
