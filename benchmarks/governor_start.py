"""The step governor (kernels/cpu.py's ThreadGovernor) in freshly started processes on a quiet machine:
each process loads the model, runs one warm-up prompt, then 5 prompts each of 16, 64 and 256 words
(max_tokens 1: time to first token, offline, no prefix cache) and reports the medians with how many of its
steps the governor held on one thread. On a quiet machine none should be: a process held from its first
steps on runs its prompts on one of the two threads.

    python benchmarks/governor_start.py [--model M] [--processes 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, statistics, sys, time
from tokenmill import LLM, SamplingParams
from tokenmill.model.hub import pull
llm = LLM(sys.argv[1] or pull(), enable_prefix_caching=False, kv_cache_memory="512MiB")
words = "the quick brown fox jumps over a lazy dog while seven cats watch from the old stone wall".split()
sp = SamplingParams(temperature=0, max_tokens=1)
llm.generate(["warm up " * 40], sp, use_tqdm=False)
out = {}
for n in (16, 64, 256):
    prompt = " ".join(words[i % len(words)] for i in range(n))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        times.append(time.perf_counter() - start)
    out[n] = statistics.median(times) * 1e3
g = llm.engine.runner.governor
print(json.dumps({"ttft_ms": out, "steps": g.steps if g else 0, "solo": g.solo_steps if g else 0}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a model path (default: the default model)")
    ap.add_argument("--processes", type=int, default=6)
    args = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    held = 0
    for i in range(args.processes):
        run = subprocess.run([sys.executable, "-c", _CHILD, args.model], capture_output=True, text=True, env=env,
                             check=True)
        r = json.loads(run.stdout.strip().splitlines()[-1])
        held += r["solo"] > 0
        t = r["ttft_ms"]
        print(f"process {i + 1}: {t['16']:.1f} / {t['64']:.1f} / {t['256']:.1f} ms at 16 / 64 / 256 words; "
              f"{r['solo']} of {r['steps']} steps on one thread", flush=True)
    print(f"{held} of {args.processes} processes had steps held on one thread")


if __name__ == "__main__":
    main()
