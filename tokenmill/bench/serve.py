"""`bench serve`: a load generator for any OpenAI-compatible completions server.

Definitions follow vLLM's `bench serve` so figures compare: TTFT is the time to the first streamed
token; ITL the gaps between later streamed chunks; TPOT = (e2e - TTFT) / (output tokens - 1); goodput
counts requests per second that meet every given SLO.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from tokenmill.bench.datasets import BenchRequest, percentiles


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def _one(client, url: str, model: str | None, req: BenchRequest, api_key: str | None) -> RequestResult:
    body = {"prompt": req.prompt_text if req.prompt_text is not None else req.prompt_ids,
            "max_tokens": req.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = RequestResult(ok=False, prompt_len=len(req.prompt_ids))
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    result.error = str(data["error"])[:200]
                    return result
                if data.get("usage"):
                    result.output_tokens = data["usage"].get("completion_tokens", 0)
                if data.get("choices") and data["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = True
    except Exception as e:  # counted as a failed request
        result.error = f"{type(e).__name__}: {e}"[:200]
    return result


async def run_load(base_url: str, requests: list[BenchRequest], request_rate: float, max_concurrency: int | None,
                   model: str | None = None, api_key: str | None = None, seed: int = 0,
                   show_progress: bool = True) -> tuple[list[RequestResult], float]:
    import httpx
    from tqdm import tqdm

    url = base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", disable=not show_progress)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def fire(req):
            if sem is None:
                res = await _one(client, url, model, req, api_key)
            else:
                async with sem:
                    res = await _one(client, url, model, req, api_key)
            bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(fire(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    bar.close()
    return results, elapsed


def summarize(results: list[RequestResult], elapsed: float, goodput: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed, "output_throughput": out_tokens / elapsed,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": out_tokens,
        "ttft_ms": _ms(percentiles([r.ttft for r in ok])),
        "tpot_ms": _ms(percentiles([r.tpot for r in ok if r.tpot is not None])),
        "itl_ms": _ms(percentiles([x for r in ok for x in r.itl])),
        "e2el_ms": _ms(percentiles([r.e2e for r in ok])),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    if goodput:
        def good(r):
            checks = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
            return all(checks[k] * 1e3 <= v for k, v in goodput.items())
        summary["goodput"] = sum(1 for r in ok if good(r)) / elapsed
    return summary


def _ms(stats: dict) -> dict:
    return {k: v * 1e3 for k, v in stats.items()}


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    if not items:
        return None
    out = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        out[key] = float(value)
    return out


def print_summary(s: dict) -> None:
    print(f"completed: {s['completed']}  failed: {s['failed']}  duration: {s['duration_s']:.2f} s")
    print(f"request throughput: {s['request_throughput']:.2f} req/s  output token throughput: "
          f"{s['output_throughput']:.1f} tok/s")
    if "goodput" in s:
        print(f"goodput: {s['goodput']:.2f} req/s")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        v = s[key]
        print(f"{label:>12}: mean {v['mean']:9.2f} ms  median {v['p50']:9.2f}  p99 {v['p99']:9.2f}")
    for e in s["errors"]:
        print("error:", e)
