"""Where a throughput workload's time goes: steps with prompt tokens against decode-only steps, the
forward passes against the rest of each step, then a cProfile of one more run.

    python benchmarks/throughput_breakdown.py [MODEL] [--num-prompts 256] [--enforce-eager]

The workload (prompts 32-512 tokens, outputs 32-256, ignore_eos) runs once to warm up (on a GPU that
records the decode graphs), then timed, then profiled.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.datasets import random_requests  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, dtype="bfloat16", enforce_eager=args.enforce_eager)
    engine, runner = llm.engine, llm.engine.runner
    reqs = random_requests(args.num_prompts, (32, 512), (32, 256), engine.vocab_size, seed=200)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]

    def workload() -> float:
        engine.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate([r.prompt_ids for r in reqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed

    print(f"warm-up: {workload():.0f} tok/s")
    spent, calls = collections.defaultdict(float), collections.Counter()

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - start
                calls[name] += 1
        return wrapper

    engine.step = timed("engine step", engine.step)
    runner.execute = timed("runner execute (forward, logits, sampling)", runner.execute)
    runner.model.forward = timed("eager forward", runner.model.forward)
    if runner.decode_graphs is not None:
        runner.decode_graphs.forward = timed("graph replay (launch only; the GPU finishes later)",
                                             runner.decode_graphs.forward)
    print(f"timed: {workload():.0f} tok/s")
    for name in spent:
        print(f"  {name}: {calls[name]} calls, {spent[name]:.2f} s, {spent[name] / calls[name] * 1e3:.2f} ms each")
    profile = cProfile.Profile()
    profile.enable()
    rate = workload()
    profile.disable()
    print(f"profiled: {rate:.0f} tok/s")
    pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
