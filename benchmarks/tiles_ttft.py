"""Time to first token of prompts of several lengths with quantized matrices in tiles of 16 rows
(TOKENMILL_QUANT_TILES=1, the default where the CPU has VNNI) against the row layout (=0): each setting in
a fresh process, alternated round by round; offline engine, no prefix cache, the median of 5 prompts a
length. A prompt's rows multiply dequantized weights, so this times the tiles' dequantization:
docs/benchmarks.md, "Weight rows interleaved by 16".

    python benchmarks/tiles_ttft.py [--model M] [--rounds 2] [--words 16 64 256 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout_ab import _TTFT_CHILD as _CHILD  # noqa: E402  (the same timed child: medians of 5 a length)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--words", type=int, nargs="+", default=[16, 64, 256, 1024])
    args = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    for r in range(args.rounds):
        for tiles in ("1", "0") if r % 2 == 0 else ("0", "1"):
            env = dict(os.environ, TOKENMILL_QUANT_TILES=tiles, PYTHONPATH=root)
            done = subprocess.run([sys.executable, "-c", _CHILD, args.model, ",".join(map(str, args.words))],
                                  env=env, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.split("RESULT ", 1)[1])
            times = ", ".join(f"{w} words {ms:.1f} ms" for w, ms in result.items())
            print(f"round {r + 1}, {'tiles' if tiles == '1' else 'rows '}: {times}", flush=True)


if __name__ == "__main__":
    main()
