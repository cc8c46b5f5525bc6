"""Self-drafting with int4 against int4-gptq: the target (a float model, bfloat16) decodes greedy
continuations of the evaluation text at batch 1 without speculation and with its own weights at 4 bits as
the draft, rounded (quantization "int4") or fitted to a calibration text (quantization "int4-gptq");
configurations alternated in rounds, each a fresh engine. Reports the share of proposed tokens accepted,
output tok/s (decode of each request after its first token, summed over requests), and checks that every
configuration produced the same tokens.

    python benchmarks/self_draft_gptq.py MODEL_FOLDER [--rounds 2] [--k 5] [--prompts 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.data import default_text  # noqa: E402
from tokenmill.model.loader import load_tokenizer  # noqa: E402


def run(model: str, draft: str | None, prompts, args) -> tuple[float, float | None, list]:
    spec = None if draft is None else {"method": "self", "quantization": draft, "num_speculative_tokens": args.k}
    llm = LLM(model, dtype="bfloat16", speculative_config=spec)
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    tokens, seconds, drafted, accepted, outs = 0, 0.0, 0, 0, []
    for p in prompts:  # batch 1
        out = llm.generate([p], params, use_tqdm=False)[0]
        m = out.metrics
        tokens += len(out.outputs[0].token_ids) - 1
        seconds += m.finished_time - m.first_token_time
        drafted += m.spec_num_draft_tokens
        accepted += m.spec_num_accepted_tokens
        outs.append(out.outputs[0].token_ids)
    del llm
    gc.collect()
    return tokens / seconds, accepted / drafted if drafted else None, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    ids = load_tokenizer(args.model).encode(default_text(), add_special_tokens=False)
    step = len(ids) // args.prompts
    prompts = [ids[i * step:i * step + args.prompt_len] for i in range(args.prompts)]
    configs = [None, "int4", "int4-gptq"]
    rates = {c: [] for c in configs}
    acceptance = {c: [] for c in configs}
    first = None
    for r in range(args.rounds):
        for c in configs if r % 2 == 0 else configs[::-1]:
            rate, acc, outs = run(args.model, c, prompts, args)
            if first is None:
                first = outs
            same = sum(a == b for a, b in zip(outs, first))
            print(f"round {r + 1} draft {c}: {rate:.1f} tok/s, acceptance {acc if acc is None else round(acc, 3)}, "
                  f"{same}/{len(outs)} outputs as the first run's", flush=True)
            rates[c].append(rate)
            acceptance[c].append(acc)
    base = statistics.median(rates[None])
    print("\n| draft | acceptance per round | decode tok/s per round | median | vs none |\n| --- | --- | --- | --- | --- |")
    for c in configs:
        med = statistics.median(rates[c])
        acc = ", ".join("-" if a is None else f"{a:.1%}" for a in acceptance[c])
        print(f"| {c or 'none'} | {acc} | {', '.join(f'{x:.1f}' for x in rates[c])} | {med:.1f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
