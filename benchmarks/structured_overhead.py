"""What structured outputs cost: grammar compile times, and the share of decode time spent on the token
mask (filling each constrained row's bitmask, applying it to the logits, advancing the matcher) at batch 1
and batch 32, on the default model.

    python benchmarks/structured_overhead.py [--model M]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.test_structured_outputs import SCHEMAS  # noqa: E402
from tokenmill import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from tokenmill.sample import sampler as sampler_module  # noqa: E402
from tokenmill.structured import backend  # noqa: E402


class Timer:
    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    llm = LLM(args.model)
    engine = llm.engine

    compile_ms = []
    for s in SCHEMAS:
        start = time.perf_counter()
        engine.grammars.compile(StructuredOutputsParams(json=s))
        compile_ms.append((time.perf_counter() - start) * 1000)
    cached = time.perf_counter()
    engine.grammars.compile(StructuredOutputsParams(json=SCHEMAS[0]))
    cached = (time.perf_counter() - cached) * 1000
    print(f"compile, {len(SCHEMAS)} JSON schemas: median {statistics.median(compile_ms):.1f} ms, "
          f"max {max(compile_ms):.1f} ms; cached {cached:.3f} ms")
    for name, spec in (("json_object", {"json_object": True}), ("regex", {"regex": r"[A-Z][a-z]{2,9} \d{1,4}"}),
                       ("grammar", {"grammar": 'root ::= "(" n ("+" n)* ")"\nn ::= [0-9]+'})):
        start = time.perf_counter()
        engine.grammars.compile(StructuredOutputsParams(**spec))
        print(f"compile, {name}: {(time.perf_counter() - start) * 1000:.1f} ms")

    # The mask's share of decode: time inside the bitmask fill, its application and the matcher's advance.
    mask = Timer()
    sampler_module.apply_bitmask = mask.wrap(sampler_module.apply_bitmask)
    backend.GrammarMatcher.fill = mask.wrap(backend.GrammarMatcher.fill)
    backend.GrammarMatcher.accept = mask.wrap(backend.GrammarMatcher.accept)
    schema = SCHEMAS[6]
    for batch in (1, 32):
        chats = [[{"role": "user", "content": f"Give a city and its population, as JSON. ({i})"}] for i in range(batch)]
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=64,
                                 structured_outputs=StructuredOutputsParams(json=schema)) for i in range(batch)]
        llm.chat(chats, params, use_tqdm=False)  # warm-up
        shares, tpots = [], []
        for _ in range(3):
            mask.seconds = 0.0
            outs = llm.chat(chats, params, use_tqdm=False)
            decode = sum((o.metrics.finished_time - o.metrics.first_token_time) for o in outs) / batch
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            steps = max(len(o.outputs[0].token_ids) for o in outs)
            span = max(o.metrics.finished_time for o in outs) - min(o.metrics.first_token_time for o in outs)
            tpots.append(decode / max(1, tokens / batch - 1))
            shares.append(mask.seconds / span if span > 0 else 0.0)
        print(f"batch {batch}: TPOT {statistics.median(tpots) * 1000:.1f} ms, mask share of the decode span "
              f"{statistics.median(shares) * 100:.1f}% ({steps} steps, {tokens} tokens in the last run)")


if __name__ == "__main__":
    main()
