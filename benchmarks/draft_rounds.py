"""Where a draft model's speculation spends its time: offline, batch 1, greedy chat answers of a target
at --quantization none (its file's weights dequantized) with and without MODEL's own quantized file as its
draft_model, alternated in rounds; then, in the draft run, the median time of each kind of call (the
target's verify steps by their rows, the draft's steps by their rows and its bursts by their steps).

    python benchmarks/draft_rounds.py [MODEL.gguf] [--k 3] [--rounds 3] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.model.hub import pull  # noqa: E402

QUESTIONS = ["What is the capital of France and why is it famous?", "Write a short poem about the sea.",
             "Explain how a bicycle works.", "Give me three tips for learning to cook."]


def timed(obj, name: str, key, into: dict) -> None:
    """Wrap obj.name so that each call's wall time is kept under key(*args)."""
    f = getattr(obj, name)

    def wrapper(*args):
        start = time.perf_counter()
        result = f(*args)
        into[key(*args)].append(time.perf_counter() - start)
        return result

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    path = args.model or pull()
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    # No prefix cache: every round the same work (a prompt found in the cache computes its last rows in
    # a chunk of another size, whose bfloat16 sums may round otherwise and change the greedy answer).
    kw = dict(quantization="none", enable_prefix_caching=False)
    engines = {"none": LLM(path, **kw),
               "draft": LLM(path, speculative_config={"method": "draft_model", "model": path,
                                                      "num_speculative_tokens": args.k}, **kw)}
    rates = collections.defaultdict(list)
    for llm in engines.values():
        llm.chat(chats[:1], sp)  # warm-up
    for r in range(args.rounds):
        for name in (engines if r % 2 == 0 else reversed(engines)):
            llm = engines[name]
            start = time.perf_counter()
            outs = [llm.chat([c], sp)[0] for c in chats]
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(tokens / (time.perf_counter() - start))
            print(f"round {r} {name:5} {tokens} tokens, {rates[name][-1]:.1f} tok/s", flush=True)
    none, draft = statistics.median(rates["none"]), statistics.median(rates["draft"])
    ratios = [d / n for n, d in zip(rates["none"], rates["draft"])]
    print(f"median tok/s: none {none:.1f}, draft {draft:.1f}; per round draft / none "
          + ", ".join(f"{x:.2f}" for x in ratios))

    llm = engines["draft"]
    times: dict = collections.defaultdict(list)
    proposer = llm.engine.proposer
    timed(llm.engine.runner, "execute", lambda s: ("target step, rows", sum(i.num_new_tokens for i in s.scheduled)),
          times)
    timed(proposer.runner, "execute", lambda s: ("draft step, rows", sum(i.num_new_tokens for i in s.scheduled)),
          times)
    timed(proposer.runner, "execute_burst", lambda s, steps, stop: ("draft burst, steps", steps), times)
    for c in chats:
        llm.chat([c], sp)
    stats = llm.engine.stats()
    print(f"accepted {stats['spec_decode_num_accepted_tokens']} of {stats['spec_decode_num_draft_tokens']} "
          "proposed tokens (all runs)")
    for (what, n), v in sorted(times.items(), key=lambda kv: -len(kv[1]))[:8]:
        print(f"{what} {n}: {len(v)} calls, median {1000 * statistics.median(v):.2f} ms")


if __name__ == "__main__":
    main()
