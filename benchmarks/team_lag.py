"""How often the fused decoder's thread team switches to one thread on a machine nobody else uses, and
what that costs: two builds of the CPU kernels (the working tree's and the one at git revision BASE)
alternated round after round, each running decode steps of the default model (the decoder's forward
alone, one request or several rows) with its team clock on. Reports, per build, the calls that ran on one
thread, the calls whose team lagged, and the mean step time (a switch costs whole runs of slower calls, so
the mean shows it where a median would not).

    python benchmarks/team_lag.py --base HEAD~1 [--rounds 4] [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


from tokenmill import LLM  # noqa: E402
from kernel_ab import decoders_at  # noqa: E402
from verify_rows import step_inputs  # noqa: E402

CASES = [(32, 1), (32, 4), (32, 8), (700, 1), (700, 8)]  # (context, rows of one request)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision of the kernels to compare against")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=200, help="calls per case and round")
    args = ap.parse_args()
    llm = LLM("smollm2-135m-instruct", enable_prefix_caching=False)
    runner = llm.engine.runner
    runner.governor = None  # the team's own clock alone
    decoders = decoders_at(args.base, llm)
    totals = {name: {"calls": 0, "solo": 0, "lagged": 0, "times": []} for name in decoders}
    for r in range(args.rounds):
        order = list(decoders)
        random.shuffle(order)
        for name in order:
            fused, t = decoders[name], totals[name]
            calls0, solo0, lagged0, _ = fused.team_stats()
            times = []
            for context, rows in CASES:
                inputs = step_inputs(context, rows, True, runner.block_size)
                for _ in range(args.calls):
                    start = time.perf_counter()
                    fused.forward(*inputs)
                    times.append(time.perf_counter() - start)
            calls, solo, lagged, _ = fused.team_stats()
            t["calls"] += calls - calls0
            t["solo"] += solo - solo0
            t["lagged"] += lagged - lagged0
            t["times"].append(sum(times))
            print(f"round {r + 1} {name}: {calls - calls0} calls, {solo - solo0} on one thread, {lagged - lagged0} "
                  f"lagged, {sum(times):.2f} s", flush=True)
    for name, t in totals.items():
        print(f"{name}: {t['calls']} calls, {t['solo']} on one thread ({100 * t['solo'] / t['calls']:.1f}%), "
              f"{t['lagged']} lagged; time per round median {statistics.median(t['times']):.2f} s")


if __name__ == "__main__":
    main()
