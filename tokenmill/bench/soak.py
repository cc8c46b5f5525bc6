"""`bench soak`: start `tokenmill serve` on 127.0.0.1 and hold it under the load operators see, for a
bounded time; then report what came back.

The load, at a fixed concurrency: whole and streamed completions and chats, long prompts, JSON-constrained
answers, clients that leave mid-stream or before a whole answer is ready, slow readers, bad requests (broken
JSON, lone surrogates, out-of-range fields, unknown models), uploads that stall half-way, and bursts of
simultaneous requests past the queue limit. Every --sample-every seconds it records the server's resident
memory and its /metrics.

Each request ends in one of three outcomes: ok, an expected 4xx (a bad request's 400/404, a 429 from the
full queue, the 408 of a stalled upload), or unexpected (a 5xx, a broken or truncated stream, a timeout, a
connection error). Phases: `--phases quiet,busy,...` runs each phase for --minutes; in a busy phase a
process spins on one of the CPUs the server may use, so contended throughput and latency can be read
against quiet ones from the same run.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import httpx

from tokenmill.bench.datasets import percentiles

# Kinds whose latency is compared across phases (the same mix of requests in each) and what each sends.
_TIMED_KINDS = ("complete", "chat_stream", "long_prompt", "structured", "slow_reader")
_WEIGHTS = {"complete": 4, "chat_stream": 4, "long_prompt": 1, "structured": 1, "slow_reader": 1,
            "leave_stream": 1, "leave_whole": 1, "bad": 2, "stalled_upload": 0.3}
_TEXT = ("The river bends twice before it reaches the old mill, where the water turns a wheel that has "
         "ground grain for two hundred years. ")


_started_in: contextvars.ContextVar[str | None] = contextvars.ContextVar("started_in", default=None)


@dataclass(slots=True)
class Outcome:
    kind: str
    phase: str
    outcome: str  # ok | expected_4xx | unexpected
    status: int | None
    latency: float
    detail: str = ""


@dataclass
class Sample:
    t: float
    phase: str
    rss_mib: float
    running: float
    waiting: float
    kv_usage: float
    generation_tokens: float


@dataclass
class SoakReport:
    model: str
    minutes_per_phase: float
    concurrency: int
    outcomes: dict = field(default_factory=dict)  # outcome -> count
    by_kind: dict = field(default_factory=dict)  # kind -> outcome -> count
    unexpected: list = field(default_factory=list)  # the first few, with their detail
    latency: dict = field(default_factory=dict)  # phase -> kind -> percentiles (ok requests)
    throughput: dict = field(default_factory=dict)  # phase -> output tok/s (server counter)
    samples: list = field(default_factory=list)
    rss_slope_mib_per_min: float | None = None
    idle_after: bool = False
    idle_state: dict = field(default_factory=dict)
    server_tracebacks: int = 0
    # Busy against quiet latency, quantile by quantile (p50, p90, p99, max) for each kind: the largest ratio,
    # and where it was. A request's own quiet latency cannot be observed in the busy phase; the same quantile
    # of the same kind's quiet latencies stands for it (a kind's latencies spread several-fold even when
    # quiet: JSON answers end when the object closes, and any request may land behind a burst).
    worst_latency_ratio: float | None = None
    worst_latency_ratio_at: str = ""
    quantile_ratios: dict = field(default_factory=dict)  # kind -> quantile -> busy / quiet
    # The cruder reading, kept for comparison with earlier runs: the slowest busy request over its kind's
    # quiet median; and the same for the slowest quiet request, which shows how far the spread alone goes.
    worst_over_quiet_median: float | None = None
    quiet_worst_over_quiet_median: float | None = None


# ---------------------------------------------------------------------- the server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, model: str, extra: list[str], log_path: str, body_timeout: float, queue: int) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--body-read-timeout", str(body_timeout), "--max-queued-requests", str(queue), *extra]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready within {timeout:g} s; see {self.log_path}")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def _metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tokenmill:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def _die_with_parent() -> None:
    """preexec_fn of the children: killed when the soak dies, however it dies (a spinner or a server left
    behind would slow everything after it)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class _Spinner:
    """A process that keeps one CPU busy (pinned to it) while a busy phase lasts."""

    def __init__(self) -> None:
        self.proc = None

    def start(self) -> None:
        cpu = sorted(os.sched_getaffinity(0))[-1]
        self.proc = subprocess.Popen([sys.executable, "-c",
                                      f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"],
                                     preexec_fn=_die_with_parent)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


# ---------------------------------------------------------------------- the requests
class _Load:
    def __init__(self, url: str, model_name: str | None, body_timeout: float, request_timeout: float, seed: int) -> None:
        self.url, self.model_name = url, model_name
        self.body_timeout, self.request_timeout = body_timeout, request_timeout
        self.rng = random.Random(seed)
        self.phase = "warm-up"
        self.results: list[Outcome] = []
        self.long_repeats = 1  # copies of _TEXT in a long prompt, fitted to the context by fit()
        self.kinds, self.weights = zip(*_WEIGHTS.items())
        self.picks = 0

    def pick(self) -> str:
        """Each kind once first (so that a short soak meets them all), then at random by weight."""
        self.picks += 1
        if self.picks <= len(self.kinds):
            return self.kinds[self.picks - 1]
        return self.rng.choices(self.kinds, self.weights)[0]

    def fit(self) -> None:
        """Learn the served model's name, and size long prompts to half its context (at most ~1,000 tokens)."""
        model = httpx.get(self.url + "/v1/models").json()["data"][0]
        self.model_name = model["id"]
        per_copy = len(httpx.post(self.url + "/tokenize", json={"prompt": _TEXT}).json()["tokens"])
        self.long_repeats = max(1, min(1000, (model.get("max_model_len") or 2048) // 2) // max(per_copy, 1))

    def record(self, kind: str, outcome: str, status: int | None, start: float, detail: str = "") -> None:
        """One request's outcome, under the phase in which it started (begin())."""
        phase = _started_in.get() or self.phase
        self.results.append(Outcome(kind, phase, outcome, status, time.monotonic() - start, detail[:300]))

    def begin(self) -> float:
        """A request starts: its time, and the phase it belongs to, for the coroutine that runs it."""
        _started_in.set(self.phase)
        return time.monotonic()

    def judge(self, kind: str, status: int, start: float, body: str = "", expect_4xx: tuple = ()) -> None:
        if status == 200 and not expect_4xx:
            self.record(kind, "ok", status, start)
        elif status == 429 or status in expect_4xx:
            self.record(kind, "expected_4xx", status, start)
        else:
            self.record(kind, "unexpected", status, start, body)

    async def one(self, client: httpx.AsyncClient, kind: str) -> None:
        start = self.begin()
        try:
            await asyncio.wait_for(getattr(self, "_" + kind)(client, start), self.request_timeout)
        except asyncio.TimeoutError:
            self.record(kind, "unexpected", None, start, f"no answer within {self.request_timeout:g} s")
        except Exception as e:  # anything else the client met is the server's doing too
            self.record(kind, "unexpected", None, start, f"{type(e).__name__}: {e}")

    async def _stream(self, client, kind: str, path: str, body: dict, start: float, read_delay: float = 0.0,
                      leave_after: int | None = None) -> None:
        async with client.stream("POST", self.url + path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return self.judge(kind, r.status_code, start, (await r.aread()).decode(errors="replace"))
            chunks, done = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if not isinstance(event, dict) or "error" in event:
                    return self.record(kind, "unexpected", 200, start, f"error event: {event['error']}")
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return self.record(kind, "ok", 200, start)  # the client leaves; the server must abort
                if read_delay:
                    await asyncio.sleep(read_delay)
            if not done or chunks == 0:
                return self.record(kind, "unexpected", 200, start, f"stream ended after {chunks} chunks without "
                                                                     "[DONE]" if not done else "an empty stream")
            self.record(kind, "ok", 200, start)

    def _chat(self, max_tokens: int) -> dict:
        question = self.rng.choice(["What is the capital of France?", "Name three colours.",
                                    "Write a sentence about rivers.", "Count from one to five."])
        return {"model": self.model_name, "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7}

    async def _complete(self, client, start):
        r = await client.post(self.url + "/v1/completions", json={
            "model": self.model_name, "prompt": _TEXT[: self.rng.randint(20, len(_TEXT))], "max_tokens": 32,
            "ignore_eos": True, "temperature": 0.7})
        self.judge("complete", r.status_code, start, r.text)

    async def _chat_stream(self, client, start):
        await self._stream(client, "chat_stream", "/v1/chat/completions", self._chat(64), start)

    async def _long_prompt(self, client, start):
        # A prompt of up to ~1,000 tokens, new each time (a random head defeats the prefix cache).
        prompt = f"{self.rng.random()} " + _TEXT * self.long_repeats
        r = await client.post(self.url + "/v1/completions", json={
            "model": self.model_name, "prompt": prompt, "max_tokens": 8, "ignore_eos": True})
        self.judge("long_prompt", r.status_code, start, r.text)

    async def _structured(self, client, start):
        r = await client.post(self.url + "/v1/chat/completions", json={
            **self._chat(24), "response_format": {"type": "json_object"}})
        self.judge("structured", r.status_code, start, r.text)

    async def _slow_reader(self, client, start):
        await self._stream(client, "slow_reader", "/v1/completions", {
            "model": self.model_name, "prompt": _TEXT, "max_tokens": 24, "ignore_eos": True}, start, read_delay=0.2)

    async def _leave_stream(self, client, start):
        await self._stream(client, "leave_stream", "/v1/chat/completions", self._chat(400), start, leave_after=3)

    async def _leave_whole(self, client, start):
        try:  # the client gives up before the answer can be ready; the server must drop the request
            r = await asyncio.wait_for(client.post(self.url + "/v1/completions", json={
                "model": self.model_name, "prompt": _TEXT, "max_tokens": 400, "ignore_eos": True}), 0.5)
            self.judge("leave_whole", r.status_code, start, r.text)
        except asyncio.TimeoutError:
            self.record("leave_whole", "ok", None, start)

    async def _bad(self, client, start):
        bodies = [
            (b'{"prompt": "abc", "max_tokens": ', 400),  # broken JSON
            (b'{"prompt": "abc \\ud800 def", "max_tokens": 4}', 400),  # a lone surrogate
            (json.dumps({"prompt": "abc", "max_tokens": -3}).encode(), 400),
            (json.dumps({"prompt": "abc", "max_tokens": 4, "temperature": "hot"}).encode(), 400),
            (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                                    {"type": "nope"}}}}).encode(),
             400),
            (json.dumps({"model": "no-such-model", "prompt": "abc", "max_tokens": 4}).encode(), 404),
            (json.dumps({"prompt": "abc", "max_tokens": 4, "n": 100000}).encode(), 400),
        ]
        body, expected = self.rng.choice(bodies)
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        r = await client.post(self.url + path, content=body, headers={"content-type": "application/json"})
        self.judge("bad", r.status_code, start, r.text, expect_4xx=(expected,))

    async def _stalled_upload(self, client, start):
        port = int(self.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 200\r\n\r\n{\"prompt\": \"half a bo")
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), self.body_timeout + 15)
        finally:
            writer.close()
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
        if status == 408:
            self.record("stalled_upload", "expected_4xx", 408, start)
        else:
            self.record("stalled_upload", "unexpected", status, start, answer[:200].decode(errors="replace"))

    async def burst(self, client: httpx.AsyncClient, size: int) -> None:
        """Many simultaneous short requests: each must get a 200 or a 429, nothing else."""
        async def one():
            start = self.begin()
            try:
                r = await asyncio.wait_for(client.post(self.url + "/v1/completions", json={
                    "model": self.model_name, "prompt": "burst", "max_tokens": 4}), self.request_timeout)
                self.judge("burst", r.status_code, start, r.text)
            except Exception as e:
                self.record("burst", "unexpected", None, start, f"{type(e).__name__}: {e}")

        await asyncio.gather(*(one() for _ in range(size)))


# ---------------------------------------------------------------------- the run
async def _drive(server: _Server, load: _Load, args, phases: list[str], report: SoakReport) -> None:
    limits = httpx.Limits(max_connections=args.concurrency + args.burst_size + 8, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        stop = asyncio.Event()
        spinner = _Spinner()

        async def worker():
            while not stop.is_set():
                await load.one(client, load.pick())

        async def bursts():
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), args.burst_every)
                except asyncio.TimeoutError:
                    await load.burst(client, args.burst_size)

        async def sample() -> Sample:
            text = (await client.get(server.url + "/metrics", timeout=30)).text
            m = _metrics(text)
            s = Sample(round(time.monotonic() - t0, 1), load.phase, round(server.rss_mib(), 1),
                       m.get("tokenmill:num_requests_running", 0.0), m.get("tokenmill:num_requests_waiting", 0.0),
                       m.get("tokenmill:kv_cache_usage_perc", 0.0), m.get("tokenmill:generation_tokens_total", 0.0))
            report.samples.append(asdict(s))
            return s

        async def sampler():
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), args.sample_every)
                except asyncio.TimeoutError:
                    start = load.begin()
                    try:
                        await sample()
                    except Exception as e:  # /metrics must answer under any load
                        load.record("metrics", "unexpected", None, start, f"{type(e).__name__}: {e}")

        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(worker()) for _ in range(args.concurrency)]
        tasks += [asyncio.ensure_future(bursts()), asyncio.ensure_future(sampler())]
        try:
            load.phase = "warm-up"
            await asyncio.sleep(args.warmup)
            for i, phase in enumerate(phases):
                if phase == "busy":
                    spinner.start()
                load.phase = f"{phase}-{i}"
                first = await sample()
                await asyncio.sleep(args.minutes * 60)
                last = await sample()
                spinner.stop()
                report.throughput[load.phase] = round(
                    (last.generation_tokens - first.generation_tokens) / max(last.t - first.t, 1e-9), 2)
                print(f"  {load.phase}: {report.throughput[load.phase]:.1f} output tok/s, "
                      f"RSS {last.rss_mib:.0f} MiB", flush=True)
        finally:
            spinner.stop()
            stop.set()
            load.phase = "end"
            for failed in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(failed, BaseException):  # a client task died: count it, never hide it
                    load.record("client", "unexpected", None, load.begin(), f"{type(failed).__name__}: {failed}")

        # Everything has ended: the server must come back to idle (nothing running, waiting, or held).
        deadline = time.monotonic() + 30
        while True:
            s = await sample()
            report.idle_state = {"running": s.running, "waiting": s.waiting, "kv_usage": s.kv_usage}
            if (s.running, s.waiting, s.kv_usage) == (0, 0, 0):
                report.idle_after = True
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(1)


def _slope(samples: list[dict], skip_s: float) -> float | None:
    """MiB per minute, least squares over the samples after the first skip_s seconds."""
    pts = [(s["t"] / 60, s["rss_mib"]) for s in samples if s["t"] >= skip_s and s["phase"] != "end"]
    if len(pts) < 3:
        return None
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    var = sum((p[0] - mx) ** 2 for p in pts)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pts) / var, 3) if var else None


def _compare_phases(report: SoakReport, quiet: dict[str, list[float]], busy: dict[str, list[float]]) -> None:
    """Fill the report's busy-against-quiet latency ratios (see SoakReport)."""
    def quantiles(lat):
        return {k: v for k, v in percentiles(lat).items() if k != "mean"} | {"max": max(lat)}

    worst, busy_over_median, quiet_over_median = (0.0, ""), 0.0, 0.0
    for kind in sorted(set(quiet) & set(busy)):
        q, b = quantiles(quiet[kind]), quantiles(busy[kind])
        ratios = report.quantile_ratios[kind] = {name: round(b[name] / q[name], 2) for name in q}
        name = max(ratios, key=ratios.get)
        worst = max(worst, (ratios[name], f"{kind} {name}"))
        busy_over_median = max(busy_over_median, b["max"] / q["p50"])
        quiet_over_median = max(quiet_over_median, q["max"] / q["p50"])
    if report.quantile_ratios:
        report.worst_latency_ratio, report.worst_latency_ratio_at = worst
        report.worst_over_quiet_median = round(busy_over_median, 2)
        report.quiet_worst_over_quiet_median = round(quiet_over_median, 2)


def summarize(load: _Load, report: SoakReport, warm_s: float) -> SoakReport:
    for o in load.results:
        report.outcomes[o.outcome] = report.outcomes.get(o.outcome, 0) + 1
        kind = report.by_kind.setdefault(o.kind, {})
        kind[o.outcome] = kind.get(o.outcome, 0) + 1
        if o.outcome == "unexpected" and len(report.unexpected) < 20:
            report.unexpected.append(asdict(o))
    timed: dict[str, dict[str, list[float]]] = {}
    for o in load.results:
        if o.outcome == "ok" and o.kind in _TIMED_KINDS and o.phase not in ("warm-up", "end"):
            timed.setdefault(o.phase, {}).setdefault(o.kind, []).append(o.latency)
    report.latency = {phase: {kind: {k: round(v, 3) for k, v in percentiles(lat).items()} | {"n": len(lat)}
                              for kind, lat in kinds.items()} for phase, kinds in timed.items()}
    quiet: dict[str, list[float]] = {}
    busy: dict[str, list[float]] = {}
    for phase, kinds in timed.items():
        for kind, lat in kinds.items():
            (quiet if phase.startswith("quiet") else busy).setdefault(kind, []).extend(lat)
    _compare_phases(report, quiet, busy)
    report.rss_slope_mib_per_min = _slope(report.samples, warm_s)
    return report


def print_report(r: SoakReport) -> None:
    print(f"soak of {r.model}: {r.concurrency} clients, {r.minutes_per_phase:g} min per phase")
    print("  outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(r.outcomes.items())))
    for kind, counts in sorted(r.by_kind.items()):
        print(f"    {kind:15s} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for u in r.unexpected[:5]:
        print(f"  unexpected: {u['kind']} status {u['status']} after {u['latency']:.1f} s: {u['detail']}")
    for phase, kinds in r.latency.items():
        print(f"  latency {phase} (s): " + "; ".join(f"{k} p50 {v['p50']:.2f} p99 {v['p99']:.2f}"
                                                     for k, v in sorted(kinds.items())))
    print("  output tok/s: " + ", ".join(f"{k} {v:.1f}" for k, v in r.throughput.items()))
    if r.worst_latency_ratio is not None:
        print(f"  busy / quiet latency, same kind and quantile: worst {r.worst_latency_ratio:.1f}x "
              f"({r.worst_latency_ratio_at})")
        for kind, ratios in sorted(r.quantile_ratios.items()):
            print(f"    {kind:15s} " + ", ".join(f"{q} {v:.2f}" for q, v in ratios.items()))
        print(f"  slowest request / its kind's quiet median: busy {r.worst_over_quiet_median:.1f}x, "
              f"quiet {r.quiet_worst_over_quiet_median:.1f}x")
    rss = [s["rss_mib"] for s in r.samples]
    if rss:
        print(f"  RSS {rss[0]:.0f} -> {rss[-1]:.0f} MiB, slope once warm {r.rss_slope_mib_per_min} MiB/min")
    print(f"  back to idle after the load: {r.idle_after} {r.idle_state}; server tracebacks: {r.server_tracebacks}")


def run_soak(args) -> SoakReport:
    from tokenmill.model.hub import DEFAULT_MODEL

    model = args.model or DEFAULT_MODEL
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or any(p not in ("quiet", "busy") for p in phases):
        raise SystemExit("--phases takes a comma-separated list of quiet and busy")
    log_path = args.server_log or tempfile.mktemp(prefix="tokenmill-soak-", suffix=".log")
    server = _Server(model, args.server_args.split(), log_path, args.body_timeout, args.max_queued_requests)
    report = SoakReport(model=model, minutes_per_phase=args.minutes, concurrency=args.concurrency)
    load = _Load(server.url, None, args.body_timeout, args.request_timeout, args.seed)
    try:
        server.wait_ready(args.ready_timeout)
        load.fit()
        print(f"soaking {model} at {server.url} (server log: {log_path})", flush=True)
        asyncio.run(_drive(server, load, args, phases, report))
    finally:
        code = server.stop()
    with open(log_path) as f:
        report.server_tracebacks = f.read().count("Traceback")
    if code != 0:
        load.results.append(Outcome("shutdown", "end", "unexpected", None, 0.0, f"the server exited with {code}"))
    return summarize(load, report, warm_s=args.warmup + min(120.0, 0.2 * args.minutes * 60 * len(phases)))


def main(args) -> int:
    """`tokenmill bench soak`: exit 0 only if nothing unexpected happened and the server came back to idle."""
    from tokenmill.bench.offline import write_json

    report = run_soak(args)
    print_report(report)
    write_json(args.json, asdict(report))
    clean = report.outcomes.get("unexpected", 0) == 0 and report.idle_after and report.server_tracebacks == 0
    return 0 if clean else 1
