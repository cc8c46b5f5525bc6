"""What the engine's proposal planning sees and decides, offline on the default model at batch 1: the
decode step's measured cost by query rows (StepCost) and how many tokens each planned step proposed
against the most it might have. With --batch N, the prompts go N at a time (one generate call each).

    python benchmarks/spec_plan.py [--workload grounded|chat] [--k 3] [--max-tokens 128] [--batch 1]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from spec_decode import chat_messages, grounded_messages

    import tokenmill.engine.engine as engine_module
    from tokenmill import LLM, SamplingParams
    from tokenmill.model.hub import pull

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=("grounded", "chat"), default="grounded")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    decisions: collections.Counter = collections.Counter()
    plan = engine_module.plan_drafts

    def counted(rates, caps, line, others=0):
        ks = plan(rates, caps, line, others)
        if line is not None:
            decisions[(tuple(caps), tuple(ks))] += 1
        return ks

    engine_module.plan_drafts = counted
    llm = LLM(pull(), speculative_config={"method": "ngram", "num_speculative_tokens": args.k},
              max_num_seqs=max(args.batch, 1))
    convs = grounded_messages() if args.workload == "grounded" else chat_messages(8)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    convs = convs[:8]
    for i in range(0, len(convs), args.batch):
        llm.chat(convs[i:i + args.batch], sp)
    cost = llm.engine.step_cost
    for rows in sorted(cost.times):
        print(f"{rows} rows: {cost.times[rows] * 1e3:.2f} ms a step ({cost.counts[rows]} steps)")
    line = cost.line(args.batch)
    print(f"line (from {args.batch} rows): " +
          (f"{line[0] * 1e3:.2f} ms + {line[1] * 1e3:.2f} ms a row" if line else "none yet"))
    print("planned steps, (most allowed, proposed): count")
    for (caps, ks), n in decisions.most_common():
        print(f"  {caps} -> {ks}: {n}")
    stats = llm.engine.stats()
    print(f"proposed {stats['spec_decode_num_draft_tokens']}, accepted {stats['spec_decode_num_accepted_tokens']}")


if __name__ == "__main__":
    main()
