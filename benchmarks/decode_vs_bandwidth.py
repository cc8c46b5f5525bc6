"""Batch-1 decode runs, each paired with the memory bandwidth measured just before and just after it.

This machine's memory switches between speeds (see docs/benchmarks.md); run for a while, every decode
run prints against the bandwidth around it, so runs in each state can be told apart.

    python benchmarks/decode_vs_bandwidth.py [--seconds 120] [--num-scheduler-steps 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill import LLM  # noqa: E402
from tokenmill.bench.roofline import decode_run, kv_bytes_per_token, memory_bandwidth, weight_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--num-scheduler-steps", type=int, default=8)
    args = ap.parse_args()
    llm = LLM(dtype="bfloat16", num_scheduler_steps=args.num_scheduler_steps)
    model = llm.engine.model
    per_token = weight_bytes(model) + kv_bytes_per_token(llm) * (args.context + 64)
    decode_run(llm, args.context)  # warm-up
    end = time.time() + args.seconds
    while time.time() < end:
        before = memory_bandwidth(repeats=3, buffer=model.weight_arena)
        rate = decode_run(llm, args.context)
        after = memory_bandwidth(repeats=3, buffer=model.weight_arena)
        print(f"bandwidth {before / 1e9:.1f} / {after / 1e9:.1f} GB/s  decode {rate:.1f} tok/s  "
              f"{100 * rate * per_token / max(before, after):.0f}% of the larger", flush=True)


if __name__ == "__main__":
    main()
