"""The server against the offline engine at equal concurrency, plus startup time and peak memory.

Starts `tokenmill serve` (default model), records the seconds from process start to a 200 from /health,
loads the same model offline in this process (max_num_seqs C), then alternates rounds: the requests
through `bench serve`'s load generator (all at once, --max-concurrency C) and the same requests offline.
Prints output tokens/s of both per round, the median ratio, and the server's peak resident memory
(VmHWM). Alternating keeps a shared machine's drifting speed out of the ratio; the idle side uses no CPU.

    python benchmarks/server_vs_offline.py [--num-prompts 128] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill.bench.datasets import random_requests  # noqa: E402
from tokenmill.bench.serve import run_load, summarize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", default="32-512")
    ap.add_argument("--output-len", default="32-256")
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.input_len.split("-"))
    olo, ohi = (int(x) for x in args.output_len.split("-"))
    reqs = random_requests(args.num_prompts, (lo, hi), (olo, ohi), 49152, seed=1)

    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(args.port),
                             "--max-num-seqs", str(args.concurrency), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.perf_counter() - start > 300:
                raise SystemExit("server did not start")
            time.sleep(0.05)
        startup = time.perf_counter() - start
        from tokenmill import LLM
        from tokenmill.bench.offline import run_throughput

        llm = LLM(max_num_seqs=args.concurrency)
        asyncio.run(run_load(url, reqs[:8], float("inf"), args.concurrency, show_progress=False))  # warm-up
        run_throughput(llm, reqs[:8])
        ratios = []
        for i in range(args.rounds):
            results, elapsed = asyncio.run(run_load(url, reqs, float("inf"), args.concurrency, show_progress=False))
            served = summarize(results, elapsed)
            offline = run_throughput(llm, reqs)
            ratios.append(served["output_throughput"] / offline["output_tokens_per_s"])
            print(f"round {i + 1}: bench serve {served['output_throughput']:.1f} output tok/s "
                  f"({served['completed']} ok, {served['failed']} failed; TTFT median {served['ttft_ms']['p50']:.0f} ms, "
                  f"TPOT median {served['tpot_ms']['p50']:.1f} ms); offline {offline['output_tokens_per_s']:.1f} "
                  f"output tok/s; ratio {ratios[-1]:.2f}", flush=True)
        with open(f"/proc/{proc.pid}/status") as f:
            peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"server startup (process start to /health 200): {startup:.1f} s; server peak RSS {peak:.0f} MiB")
    print(f"server / offline (median of {args.rounds} rounds): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
