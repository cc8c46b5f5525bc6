"""TTFT of a ~1,000-token prompt sharing 90% of its tokens with an earlier one, prefix caching on vs off.

Both engines run in one process and alternate, trial by trial; each trial first computes the earlier
prompt (its blocks stay cached), then times the new one. Prints the medians and their ratio.

    python benchmarks/prefix_cache_ttft.py [--model MODEL] [--trials 7] [--prompt-len 1000] [--shared 0.9]
"""

from __future__ import annotations

import argparse
import random
import statistics

from tokenmill import LLM, SamplingParams


def ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time, out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--shared", type=float, default=0.9)
    args = ap.parse_args()

    common = dict(dtype=args.dtype, kv_cache_memory="512MiB", max_num_batched_tokens=2048)
    engines = {"on": LLM(args.model, enable_prefix_caching=True, **common),
               "off": LLM(args.model, enable_prefix_caching=False, **common)}
    vocab = engines["on"].engine.vocab_size
    rng = random.Random(0)
    n_shared = int(args.prompt_len * args.shared)
    times: dict[str, list[float]] = {"on": [], "off": []}
    cached: list[int] = []
    for trial in range(args.trials + 1):  # trial 0 is the warm-up
        shared = [rng.randrange(100, vocab) for _ in range(n_shared)]
        first = shared + [rng.randrange(100, vocab) for _ in range(args.prompt_len - n_shared)]
        second = shared + [rng.randrange(100, vocab) for _ in range(args.prompt_len - n_shared)]
        order = ["on", "off"] if trial % 2 else ["off", "on"]
        for name in order:
            llm = engines[name]
            ttft(llm, first)
            t, hit = ttft(llm, second)
            if trial:
                times[name].append(t)
                if name == "on":
                    cached.append(hit)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"prompt {args.prompt_len} tokens, {n_shared} shared with the previous prompt; {args.trials} trials")
    print(f"TTFT prefix caching off: {off * 1e3:8.1f} ms (median)")
    print(f"TTFT prefix caching on:  {on * 1e3:8.1f} ms (median), {statistics.median(cached):.0f} tokens from cache")
    print(f"ratio off/on: {off / on:.1f}x")


if __name__ == "__main__":
    main()
