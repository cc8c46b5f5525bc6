"""Paired A/B of two versions of the sampler (tokenmill/sample/sampler.py) on sampled batch-1 decode of
the default model, alternating the two round after round in one process.

    python benchmarks/sampler_ab.py --base HEAD~1 [--temperature 0.8] [--top-p 0.9] [--seconds 120] [--batch 1]

Loads the sampler module at git revision BASE beside the working tree's; each round runs the same
128-token sampled generation (after a real prompt; --batch copies of it, each with a seed of its own)
with each, in random order, and times 127 decode steps (128 tokens less the first). Prints the median
tokens/s of each (all requests' tokens) and the median per-round ratio.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.sample import sampler as current  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision of the sampler to compare against")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    args = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    source = subprocess.run(["git", "show", f"{args.base}:tokenmill/sample/sampler.py"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    base = types.ModuleType("base_sampler")
    exec(compile(source, "base_sampler", "exec"), base.__dict__)

    llm = LLM(dtype="bfloat16", max_num_seqs=max(args.batch, 1))
    runner = llm.engine.runner
    vocab = llm.engine.vocab_size
    samplers = {"base": base.Sampler(vocab, 0), "new": current.Sampler(vocab, 0)}
    prompt = [llm.get_tokenizer().encode("Write a short story about a lighthouse keeper who finds a message "
                                         "in a bottle.")] * args.batch
    full, first = ([SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n, ignore_eos=True,
                                   seed=1 + i) for i in range(args.batch)] for n in (128, 1))
    llm.generate(prompt, full, use_tqdm=False)  # warm-up
    rounds = []
    end = time.time() + args.seconds
    while time.time() < end:
        r = {}
        for name in random.sample(list(samplers), 2):
            runner.sampler = samplers[name]
            t = time.perf_counter()
            llm.generate(prompt, first, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(prompt, full, use_tqdm=False)
            t2 = time.perf_counter()
            r[name] = 127 * args.batch / ((t2 - t1) - (t1 - t))
        rounds.append(r)
    b = statistics.median(r["base"] for r in rounds)
    n = statistics.median(r["new"] for r in rounds)
    ratio = statistics.median(r["new"] / r["base"] for r in rounds)
    print(f"{len(rounds)} rounds, batch {args.batch}, temperature {args.temperature}, top_p {args.top_p}: "
          f"base {b:.1f} tok/s, "
          f"new {n:.1f} tok/s, new/base {ratio:.3f} (median of per-round ratios)")


if __name__ == "__main__":
    main()
