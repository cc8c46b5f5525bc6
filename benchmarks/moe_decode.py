"""Decode of a mixture-of-experts model: the fused decode step against module-by-module steps, alternated.

    python benchmarks/moe_decode.py [--folder DIR] [--rounds 3] [--tokens 64] [--batch 1 8]
        [--quantization none int4]

Builds once (in --folder) a Qwen3-MoE-shaped model with random weights and the default model's tokenizer:
hidden 1024, 12 layers, 16 query / 4 KV heads of 64, 32 experts of 384 rows, 8 of them per token (0.55B
parameters, 0.17B active per token). Speed does not depend on the weights' values; requests ignore EOS.

Each round is a fresh process for each quantization: it loads the model, then for each batch size times
greedy decode with the fused step on and off in turn (prompt steps run module by module either way).
Decode rate: batch * (tokens - 1) over the time of a --tokens generation less that of a one-token one
(the prompts' prefill). Medians over the rounds, and the fused / module ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_CHILD = r"""
import json, sys, time
from tokenmill import LLM, SamplingParams
folder, quantization, tokens, batches = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(folder, dtype="bfloat16", quantization=quantization, kv_cache_memory="256MiB",
          enable_prefix_caching=False)
model = llm.engine.model

def timed(batch, n):
    prompts = [[(i * 7919 + b * 104729) % 40000 + 100 for i in range(32)] for b in range(batch)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t

out = {}
for batch in batches:
    for fused in (True, False, True, False):  # the first pair warms up
        model.use_fused_decode = fused
        rate = batch * (tokens - 1) / (timed(batch, tokens) - timed(batch, 1))
        out[f"{batch}-{'fused' if fused else 'module'}"] = rate
print(json.dumps(out))
"""


def make_model(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from tokenmill import LLM

    tokenizer = LLM(dtype="float32", device="cpu", kv_cache_memory=1 << 24).get_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384,
                         num_experts=32, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=12,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                         tie_word_embeddings=False, initializer_range=0.02, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", default=os.path.expanduser("~/.cache/tokenmill/bench-qwen3-moe"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--quantization", nargs="+", default=["none", "int4"])
    args = ap.parse_args()
    folder = Path(args.folder)
    if not folder.exists():
        make_model(folder)
    results: dict[str, dict[str, list[float]]] = {q: {} for q in args.quantization}
    for r in range(args.rounds):
        for q in args.quantization:
            out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), q, str(args.tokens),
                                  json.dumps(args.batch)], capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            rates = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"round {r + 1} {q}: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()), flush=True)
            for k, v in rates.items():
                results[q].setdefault(k, []).append(v)
    print("\n| weights | batch | fused tok/s | module by module tok/s | fused / module |")
    print("| --- | --- | --- | --- | --- |")
    for q in args.quantization:
        for b in args.batch:
            f, m = statistics.median(results[q][f"{b}-fused"]), statistics.median(results[q][f"{b}-module"])
            print(f"| {'bf16' if q == 'none' else q} | {b} | {f:.1f} | {m:.1f} | {f / m:.2f}x |")


if __name__ == "__main__":
    main()
