"""Time to first token of short prompts with bfloat16 products switching to the dequantized-tile path at 16
rows against 48 (alternated rounds, prefix cache reset before each prompt): docs/benchmarks.md, "4- and
5-bit products and the bfloat16 switch".

    python benchmarks/float_rows_ttft.py [--model M] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kernels import quant  # noqa: E402

LENGTHS = (16, 24, 37, 47)
SWITCHES = (48, 16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="bfloat16")
    vocab = llm.engine.vocab_size
    first = SamplingParams(temperature=0, max_tokens=1)
    times: dict = {}
    for _ in range(args.rounds):
        for rows in SWITCHES:
            quant.set_float_rows(rows)
            for n in LENGTHS:
                ts = []
                for i in range(9):  # the first is a warm-up
                    llm.engine.reset_prefix_cache()
                    out = llm.generate([[(1000 + 7 * j + i) % vocab for j in range(n)]], first, use_tqdm=False)[0]
                    ts.append(out.metrics.first_token_time - out.metrics.arrival_time)
                times.setdefault((rows, n), []).append(statistics.median(ts[1:]))
    quant.set_float_rows(0)
    for n in LENGTHS:
        a, b = (statistics.median(times[rows, n]) * 1e3 for rows in SWITCHES)
        print(f"prompt {n}: TTFT switching at 48 rows {a:.1f} ms, at 16 rows {b:.1f} ms ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
