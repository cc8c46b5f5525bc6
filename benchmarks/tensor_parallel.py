"""Tensor parallelism on one host: TP=2 with one thread a rank against TP=1 with two threads, side by side.

Both engines live in this process (rank 0 of the split one here, its rank 1 a process of its own) and take
turns, round after round, each decoding the same requests: one greedy request (bursts of greedy steps), one
sampled request (one engine step a token: a step description goes to rank 1 every token), and a batch of 8
greedy requests. Reports output tokens/s, medians over the rounds, the ratio, and for the split engine
where rank 0's time goes: in its sums and gathers (copying, adding, and waiting for rank 1) and the rest.

    python benchmarks/tensor_parallel.py [MODEL] [--rounds 5] [--tokens 256] [--quantization auto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402

PROMPT = "Tell me a long story about a dragon who learned to read."


def cases(tokens: int) -> dict:
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=tokens, ignore_eos=True)
    return {"batch 1, greedy": ([PROMPT], greedy), "batch 1, sampled": ([PROMPT], sampled),
            "batch 8, greedy": ([f"{PROMPT} Chapter {i}." for i in range(8)], greedy)}


def run(llm: LLM, threads: int, prompts, params) -> tuple[float, ...]:
    """Output tokens/s of one generate call, then for each rank of a split engine the shares of the call's
    time it spent in the group's sums, and waiting in them."""
    torch.set_num_threads(threads)
    tp = llm.engine.tp
    ranks = range(tp.world) if tp else ()
    before = [tp.group.stats(r) for r in ranks]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = [tp.group.stats(r) for r in ranks]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    shares = [(a[i] - b[i]) / wall for a, b in zip(after, before) for i in (1, 2)]
    return (tokens / wall, *shares)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    threads = len(os.sched_getaffinity(0))
    common = dict(kv_cache_memory="256MiB", quantization=args.quantization, enable_prefix_caching=False)
    whole = LLM(args.model, **common)
    split = LLM(args.model, tensor_parallel_size=2, **common)
    engines = {"TP=1": (whole, threads), "TP=2": (split, split.engine.tp.threads)}
    results = {(case, name): [] for case in cases(args.tokens) for name in engines}
    for name, (llm, n) in engines.items():  # warm-up
        run(llm, n, [PROMPT], SamplingParams(temperature=0, max_tokens=32))
    for r in range(args.rounds):
        for case, (prompts, params) in cases(args.tokens).items():
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                llm, n = engines[name]
                results[case, name].append(run(llm, n, prompts, params))
    print(f"model {args.model}, {threads} CPUs; TP=1: {threads} threads, TP=2: "
          f"{split.engine.tp.threads} thread(s) a rank; medians of {args.rounds} rounds")
    print("| case | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 | rank 0 in sums (waiting) | rank 1 in sums (waiting) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in cases(args.tokens):
        a = statistics.median(x[0] for x in results[case, "TP=1"])
        b, busy0, wait0, busy1, wait1 = (statistics.median(x[i] for x in results[case, "TP=2"]) for i in range(5))
        print(f"| {case} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {busy0:.0%} ({wait0:.0%}) | {busy1:.0%} ({wait1:.0%}) |")
    split.engine.shutdown()


if __name__ == "__main__":
    main()
