"""Time between streamed tokens of running requests while a long prompt arrives.

Starts `tokenmill serve` (from this checkout, or from another one given with --checkout), runs --streams
streaming requests that decode for a while, sends one prompt of --prompt-len tokens once they all stream,
and reports the gaps between the running streams' tokens (p50, p99, max) before and while the long prompt
is computed, and that prompt's time to first token.

    python benchmarks/decode_during_prefill.py [--checkout DIR] [--prompt-len 4096] [--streams 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


async def stream(client, url: str, body: dict, gaps: list, stamps: list) -> None:
    async with client.stream("POST", url, json=body) as r:
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"]
            if not choice or not choice[0]["text"]:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append((now, now - last))
            stamps.append(now)
            last = now


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def run(server_url: str, args) -> dict:
    url = server_url + "/v1/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        gaps: list = []
        stamps = [[] for _ in range(args.streams)]
        body = {"max_tokens": args.decode_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        tasks = [asyncio.create_task(stream(client, url, {**body, "prompt": f"Story {i}: once upon a time"}, gaps,
                                            stamps[i])) for i in range(args.streams)]
        while not all(len(s) >= 8 for s in stamps):
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.warm_s)
        sent = time.perf_counter()
        prompt = [100 + (i * 7919) % 40000 for i in range(args.prompt_len)]
        long = await client.post(url, json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        done = time.perf_counter()
        assert long.status_code == 200, long.text
        for t in tasks:
            t.cancel()
        before = [g for t, g in gaps if t < sent]
        during = [g for t, g in gaps if sent <= t <= done + 0.5]
        return {"long_prompt_ttft_s": done - sent,
                "gap_before": {"p50": pct(before, 0.5), "p99": pct(before, 0.99), "n": len(before)},
                "gap_during": {"p50": pct(during, 0.5), "p99": pct(during, 0.99), "max": max(during, default=0),
                               "n": len(during)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", default=None, help="another checkout of tokenmill to serve from")
    p.add_argument("--model", default=None, help="model to serve (default: the built-in default)")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=2000)
    p.add_argument("--warm-s", type=float, default=2.0)
    p.add_argument("--server-args", default="", help="extra serve flags, e.g. '--max-num-batched-tokens 512'")
    args = p.parse_args()
    from tests.server_utils import ServerProcess
    from tokenmill.model.hub import pull

    model = args.model or pull()
    env = {"PYTHONPATH": os.path.abspath(args.checkout)} if args.checkout else None
    srv = ServerProcess(model, *args.server_args.split(), env=env, ready_timeout=300)
    try:
        out = asyncio.run(run(srv.url, args))
    finally:
        srv.stop()
    out["checkout"] = args.checkout or "this one"
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
