"""Data parallelism on a multi-tenant workload: the prefix-aware router against round-robin, and DP=2 against DP=1.

Routing: `tokenmill serve --data-parallel-size 2` with each router in turn. 8 tenants each have a shared
system prompt of ~1,000 tokens; each request is a tenant's prompt (tenant drawn at random) plus a short
question of its own, sent at Poisson arrivals and streamed; TTFT is the time to the first streamed token as
the client sees it. The KV cache of each replica (--kv-cache-memory) holds about half of the tenants' prompts,
as when the tenants' prompts together outgrow one replica's cache. The prefix-cache hit rate is the cached
prompt tokens reported in the responses' usage over the ideal: every request but each tenant's first finds
all its system prompt's full blocks cached.

Throughput: unique prompts (no shared prefix), a fixed number in flight until all are done; DP=2 with one
thread per replica against one server (DP=1) with both threads, both servers up, runs alternating (medians).
Output tokens per second of each whole run.

    python benchmarks/data_parallel.py [--model MODEL] [--requests 48] [--rate 0.6] [--kv-cache-memory 112MiB]
                                       [--skip-routing] [--skip-throughput] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `tokenmill serve` process, ready when /health says so (every replica, with data parallelism)."""

    def __init__(self, model: str | None, *args: str, replicas: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", *([model] if model else []), "--port",
               str(self.port), "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                health = httpx.get(self.url + "/health", timeout=2)
                if health.status_code == 200 and all(r["status"] == "ready"
                                                     for r in health.json().get("replicas", [{"status": "ready"}])):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the server was not ready in time")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                     ignore_eos: bool = False) -> dict:
    """One streamed completion: TTFT, tokens, cached prompt tokens, the replica that served it."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": ignore_eos,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, usage, replica = None, None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        replica = r.headers.get("x-tokenmill-replica")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter()
            if event.get("usage"):
                usage = event["usage"]
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "latency": end - start, "tokens": usage["completion_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"], "replica": replica}


def tenant_workload(vocab: int, tenants: int, system_len: int, question_len: int, requests: int, rate: float,
                    seed: int) -> list[tuple[float, int, list[int]]]:
    """(arrival time, tenant, prompt) for each request: Poisson arrivals, tenants drawn at random."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, vocab) for _ in range(system_len)] for _ in range(tenants)]
    out, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        tenant = rng.randrange(tenants)
        out.append((t, tenant, systems[tenant] + [rng.randrange(100, vocab) for _ in range(question_len)]))
    return out


async def run_open_loop(url: str, workload, max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def one(at: float, tenant: int, prompt: list[int]) -> dict:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return {**await stream_one(client, url, prompt, max_tokens), "tenant": tenant}

        return await asyncio.gather(*(one(*w) for w in workload))


async def run_closed_loop(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> float:
    """Output tokens per second with `concurrency` requests in flight until all are done."""
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        queue = list(prompts)
        tokens = 0

        async def worker():
            nonlocal tokens
            while queue:
                done = await stream_one(client, url, queue.pop(), max_tokens, ignore_eos=True)
                tokens += done["tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens / (time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=0.6, help="mean arrivals per second")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="112MiB", help="per replica, in the routing runs")
    ap.add_argument("--throughput-requests", type=int, default=48)
    ap.add_argument("--throughput-prompt-len", type=int, default=200)
    ap.add_argument("--throughput-max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="throughput runs of each server")
    ap.add_argument("--skip-routing", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from tokenmill.kernels.cpu import usable_cpus
    from tokenmill.model.hub import resolve_model_path
    from tokenmill.model.loader import load_tokenizer

    model = resolve_model_path(args.model)
    vocab = len(load_tokenizer(model))
    cpus = usable_cpus()
    workload = tenant_workload(vocab, args.tenants, args.system_len, args.question_len, args.requests, args.rate,
                               args.seed)
    ideal = 0
    seen = set()
    for _, tenant, _ in workload:
        if tenant in seen:
            ideal += args.system_len // 16 * 16
        seen.add(tenant)
    print(f"{args.tenants} tenants x {args.system_len}-token system prompt + {args.question_len}-token question, "
          f"{args.requests} requests at {args.rate}/s (Poisson), {args.max_tokens} tokens each; "
          f"{cpus} CPUs; KV cache {args.kv_cache_memory} per replica")
    results = {}
    for router in () if args.skip_routing else ("prefix", "round_robin"):
        server = Server(model, "--data-parallel-size", "2", "--router", router, "--kv-cache-memory",
                        args.kv_cache_memory)
        try:
            out = asyncio.run(run_open_loop(server.url, workload, args.max_tokens))
        finally:
            server.stop()
        ttfts = [r["ttft"] for r in out]
        hit = sum(r["cached"] for r in out) / ideal
        per_replica = {k: sum(1 for r in out if r["replica"] == k) for k in ("0", "1")}
        results[router] = statistics.median(ttfts)
        print(f"  DP=2 {router:<11}: TTFT p50 {statistics.median(ttfts) * 1e3:7.0f} ms, p90 "
              f"{pct(ttfts, 0.9) * 1e3:7.0f} ms; prefix-cache hits {hit * 100:5.1f}% of ideal; "
              f"requests per replica {per_replica}")
    if results:
        print(f"  TTFT p50 round_robin / prefix: {results['round_robin'] / results['prefix']:.2f}x")

    if args.skip_throughput:
        return
    rng = random.Random(args.seed + 1)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.throughput_prompt_len)]
               for _ in range(args.throughput_requests)]
    print(f"throughput: {args.throughput_requests} unique {args.throughput_prompt_len}-token prompts x "
          f"{args.throughput_max_tokens} tokens, {args.concurrency} in flight")
    servers = {"DP=1": Server(model, "--no-enable-prefix-caching")}
    try:
        servers["DP=2"] = Server(model, "--data-parallel-size", "2", "--no-enable-prefix-caching")
        rates: dict[str, list[float]] = {name: [] for name in servers}
        for name, server in servers.items():  # warm-up
            asyncio.run(run_closed_loop(server.url, prompts[:4], 8, 4))
        for _ in range(args.rounds):
            for name, server in servers.items():
                rates[name].append(asyncio.run(run_closed_loop(server.url, prompts, args.throughput_max_tokens,
                                                               args.concurrency)))
    finally:
        for server in servers.values():
            server.stop()
    for name, runs in rates.items():
        threads = cpus if name == "DP=1" else max(1, cpus // 2)
        print(f"  {name} ({threads} thread(s) per engine): {statistics.median(runs):7.1f} output tokens/s "
              f"(median of {', '.join(f'{r:.1f}' for r in runs)})")
    print(f"  DP=2 / DP=1: {statistics.median(rates['DP=2']) / statistics.median(rates['DP=1']):.2f}x")


if __name__ == "__main__":
    main()
