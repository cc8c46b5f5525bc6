"""Time to first token where the prefix cache holds all of a prompt but its last few tokens, with a prompt's
rows on float inputs (the default) against int8 inputs below the row switch (alternated rounds, medians):
docs/benchmarks.md, "A prompt's rows on float inputs".

Each prompt is 64 cached tokens (4 blocks) and a tail of 1-20 tokens, computed as one chunk of that many
rows; the tail changes from sample to sample, so that only the 64 tokens are found in the cache.

    python benchmarks/prompt_rows_ttft.py [--model M] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kernels import quant  # noqa: E402

TAILS = (1, 5, 12, 19)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="bfloat16")
    vocab = llm.engine.vocab_size
    prefix = [(1000 + 7 * j) % vocab for j in range(64)]
    first = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prefix + [5]], first, use_tqdm=False)  # the 64 tokens into the cache
    times: dict = {}
    sample = 0
    for _ in range(args.rounds):
        for on in (False, True):
            quant.set_float_prompts(on)
            for n in TAILS:
                ts = []
                for _ in range(9):  # the first is a warm-up
                    sample += 1
                    tail = [(3000 + 13 * sample + j) % vocab for j in range(n)]
                    out = llm.generate([prefix + tail], first, use_tqdm=False)[0]
                    assert out.num_cached_tokens == 64, out.num_cached_tokens
                    ts.append(out.metrics.first_token_time - out.metrics.arrival_time)
                times.setdefault((on, n), []).append(statistics.median(ts[1:]))
    quant.set_float_prompts(True)
    for n in TAILS:
        a, b = (statistics.median(times[on, n]) * 1e3 for on in (False, True))
        print(f"tail of {n:2d}: TTFT int8 inputs {a:.1f} ms, float inputs {b:.1f} ms ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
