"""How the sampling defaults answer, and what sampling costs: the figures of docs/benchmarks.md,
"Sampling defaults".

1. Ten factual questions in chat, SEEDS seeds each, 24 tokens, counted right when the answer holds the
   expected word, under several sampling settings given explicitly (neutral, llama.cpp's, the model
   card's, greedy) and under the engine's own defaults (no settings given).
2. Batch-16 throughput of 64-token completions (prompts included) with greedy, neutral and the card's
   settings, alternated over --rounds.

    python benchmarks/sampling_defaults.py [--model M] [--quantization auto|none] [--seeds 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.test_sampling_defaults import QUESTIONS  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

SETTINGS = {
    "neutral (temperature 1)": dict(),
    "llama.cpp 0.8/40/0.95/0.05": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "model card 0.2/0.9": dict(temperature=0.2, top_p=0.9),
    "greedy": dict(temperature=0),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(args.model, quantization=args.quantization)
    print("engine defaults:", llm.engine.sampling_defaults.describe())
    chats = [[{"role": "user", "content": q}] for q, _ in QUESTIONS for _ in range(args.seeds)]
    settings = {**SETTINGS, "the engine's defaults": None}
    for name, kw in settings.items():
        base = llm.get_default_sampling_params() if kw is None else SamplingParams(**kw)
        params = [base.clone(seed=s, max_tokens=24) for _ in QUESTIONS for s in range(args.seeds)]
        outs = [o.outputs[0].text for o in llm.chat(chats, params, use_tqdm=False)]
        per = [sum(bool(re.search(QUESTIONS[i][1], outs[i * args.seeds + s])) for s in range(args.seeds))
               for i in range(len(QUESTIONS))]
        print(f"{name:28s} {sum(per):3d} of {len(outs)} right; per question {per}", flush=True)

    prompts = [f"Write a short story about the number {i}." for i in range(16)]
    for r in range(args.rounds):
        for name in ("greedy", "neutral (temperature 1)", "model card 0.2/0.9"):
            ps = [SamplingParams(max_tokens=64, ignore_eos=True, seed=i, **SETTINGS[name]) for i in range(16)]
            llm.engine.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(prompts, ps, use_tqdm=False)
            print(f"round {r} batch 16, {name:24s} {16 * 64 / (time.perf_counter() - start):6.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
