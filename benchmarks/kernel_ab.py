"""Paired A/B of two versions of the CPU kernels on one model (the default one unless --model names
another), alternating the two builds round after round.

    python benchmarks/kernel_ab.py --base HEAD~1 [--contexts 200,1500] [--seconds 120]
    python benchmarks/kernel_ab.py --base HEAD~1 --workload generate [--seconds 300]
    python benchmarks/kernel_ab.py --base HEAD~1 --model FILE.gguf
    python benchmarks/kernel_ab.py --base HEAD~1 --batch 4 [--contexts 32,700] [--quantization none]

Builds the working tree's tokenmill/kernels/cpu_kernels.cpp and the one at git revision BASE (with that
revision's headers). Each round probes the memory bandwidth, then runs every case with each build in
random order:
- forward (default): a real decode step of `--batch` requests (1 unless given) captured at each
  context, the fused decoder's forward alone (the median of 3 passes);
- generate: a whole greedy generation of 128 tokens after a 128-token prompt through the engine
  (decode in bursts), timed less the same prompt's first token, 128 tokens either way (a build whose
  sums are rounded in another order may choose other tokens: it says so).
Rounds are grouped by the memory state their probe found, since this machine's memory switches
between two speeds. Differences under a few percent are within what two copies of one build show here.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import tokenmill.kernels.cpu as cpu_kernels  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

FAST_GBPS = 45.0  # probe readings above this: the memory's fast state


def capture_step(llm: LLM, context: int, batch: int = 1):
    """The model inputs of a real decode step of `batch` requests at the given context length (decode steps
    reach the model through forward, or decode_logits where the logits come from the same call)."""
    engine, model = llm.engine, llm.engine.model
    captured = {}
    real = {name: getattr(model, name) for name in ("forward", "decode_logits")}

    def spy(name):
        def call(ids, pos, kv, meta):
            # a step of decode rows only, the widest seen (requests whose prompts came in later steps
            # decode alone at first, and the first to finish leave the last steps narrower)
            if (meta.decode_block_tables is not None and len(ids) == len(meta.decode_block_tables)
                    and len(ids) >= len(captured.get("ids", ()))):
                captured.update(ids=ids, pos=pos, meta=meta)
            return real[name](ids, pos, kv, meta)
        return call

    for name in real:
        setattr(model, name, spy(name))
    try:
        # (several long prompts take more than one step's token budget: tokens enough for all to decode together)
        tokens = 3 if batch == 1 else 16
        for b in range(batch):
            engine.add_request(None, [(1000 + 7 * j + 13 * b) % engine.vocab_size for j in range(context - tokens + 1)],
                               SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        for name, fn in real.items():
            setattr(model, name, fn)
    return captured


def kernel_sources_at(base: str, names) -> str:
    """A new folder holding the files `names` of tokenmill/kernels as they were at git revision `base` (a
    source built from there finds its headers beside it, before the working tree's). A header the revision
    did not have yet is left out (its sources do not include it)."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    base_dir = tempfile.mkdtemp()
    for name in names:
        shown = subprocess.run(["git", "show", f"{base}:tokenmill/kernels/{name}"], cwd=root, capture_output=True, text=True)
        if shown.returncode != 0 and name.endswith(".h"):
            continue
        shown.check_returncode()
        source = shown.stdout
        with open(os.path.join(base_dir, name), "w") as f:
            f.write(source)
    return base_dir


def decoders_at(base: str, llm: LLM) -> dict:
    """The engine's fused decoder twice, {"base": ..., "new": ...}: from the CPU kernels as they were at git
    revision `base` and from the working tree's, each built for this CPU, on the engine's own weights and
    KV cache. The working tree's build is the kernel module in force afterwards."""
    base_dir = kernel_sources_at(base, ("cpu_kernels.cpp", *map(os.path.basename, cpu_kernels._HEADERS)))
    base_file = os.path.join(base_dir, "cpu_kernels.cpp")
    runner = llm.engine.runner
    decoders = {}
    for name, path in (("base", base_file), ("new", cpu_kernels._SOURCE)):
        cpu_kernels._module = cpu_kernels.build(path)
        decoders[name] = llm.engine.model._build_fused_decoder(runner.kv_caches, runner.block_size)
    return decoders


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision of the kernels to compare against")
    ap.add_argument("--contexts", default="200,1500")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--workload", choices=["forward", "generate"], default="forward")
    ap.add_argument("--model", default=None, help="a GGUF file, HF folder or known name (default: the built-in model)")
    ap.add_argument("--batch", type=int, default=1, help="requests in the captured decode step (forward)")
    ap.add_argument("--quantization", default="auto", help="none: a quantized file's weights dequantized (dense bf16)")
    args = ap.parse_args()
    llm = LLM(args.model, dtype="bfloat16", max_model_len=4096, quantization=args.quantization,
              num_scheduler_steps=1 if args.workload == "forward" else 8)
    if args.workload == "forward":
        cases = {f"context {c}" + (f", batch {args.batch}" if args.batch > 1 else ""): forward_case(llm, c, args.batch)
                 for c in map(int, args.contexts.split(","))}
    else:
        cases = {"generate 128 tokens": generate_case(llm)}
    decoders = decoders_at(args.base, llm)
    probe = torch.ones(1 << 26)  # 256 MiB
    rounds = []
    end = time.time() + args.seconds
    with torch.inference_mode():
        while time.time() < end:
            start = time.perf_counter()
            probe.sum()
            r = {"GBps": probe.numel() * 4 / (time.perf_counter() - start) / 1e9}
            pairs = [(n, c) for n in decoders for c in cases]
            random.shuffle(pairs)
            for name, c in pairs:
                r[name, c] = cases[c](decoders[name])
            rounds.append(r)
    for state, chosen in (("fast", [r for r in rounds if r["GBps"] > FAST_GBPS]),
                          ("usual", [r for r in rounds if r["GBps"] <= FAST_GBPS])):
        if not chosen:
            print(f"{state} memory state: no rounds")
            continue
        for c in cases:
            base = statistics.median(r["base", c] for r in chosen) * 1e3
            new = statistics.median(r["new", c] for r in chosen) * 1e3
            ratio = statistics.median(r["new", c] / r["base", c] for r in chosen)
            print(f"{state} memory state, {len(chosen)} rounds, {c}: base {base:.2f} ms, new {new:.2f} ms, "
                  f"new/base {ratio:.3f} (median of per-round ratios)")


def forward_case(llm: LLM, context: int, batch: int = 1):
    """Times the fused forward of a real decode step at the given context (the median of 3 passes)."""
    s = capture_step(llm, context, batch)
    assert len(s["ids"]) == batch, "the captured step holds another number of requests"

    def run(decoder) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            decoder.forward(s["ids"], s["pos"], s["meta"].slot_mapping, s["meta"].decode_block_tables,
                            s["meta"].decode_seq_lens)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    return run


def generate_case(llm: LLM):
    """Times 127 greedy decode steps (the time of 128 tokens less that of the first) with a given decoder
    in the engine's place; the builds must agree on the tokens."""
    model = llm.engine.model
    prompt = [[(1000 + 7 * j) % llm.engine.vocab_size for j in range(128)]]
    first, full = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 128))
    llm.generate(prompt, full, use_tqdm=False)  # builds the engine's own decoder, whose key is reused
    key = model._fused[0]
    tokens, noted = [], []

    def run(decoder) -> float:
        model._fused = (key, decoder)
        t = time.perf_counter()
        llm.generate(prompt, first, use_tqdm=False)
        t1 = time.perf_counter()
        out = llm.generate(prompt, full, use_tqdm=False)
        t2 = time.perf_counter()
        tokens.append(out[0].outputs[0].token_ids)
        assert len(tokens[-1]) == len(tokens[0])
        if tokens[-1] != tokens[0] and not noted:
            noted.append(True)
            print("note: the two builds chose different tokens (their sums are rounded in another order)")
        return (t2 - t1) - (t1 - t)

    return run


if __name__ == "__main__":
    main()
