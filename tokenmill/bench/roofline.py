"""`bench roofline`: this machine's limits, and how close the model's decode and prefill come to them.

Decode reads every weight (and the KV cache) once per token, so tokens/s <= bandwidth / bytes per token.
Prefill does 2 x parameters FLOPs per token, so tokens/s <= matmul FLOP/s / (2 x parameters).
"""

from __future__ import annotations

import statistics
import time

import torch

from tokenmill.sampling_params import SamplingParams


def _best(fn, repeats: int, device: torch.device) -> float:
    """Best wall time of fn over repeats after one warm-up; GPU work is waited for inside each timing."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def memory_bandwidth(repeats: int = 7, size_bytes: int = 1 << 30, buffer: torch.Tensor | None = None,
                     device: torch.device | str = "cpu") -> float:
    """Read bandwidth in bytes/s of the device's memory: best time to reduce a buffer far larger than the
    caches (a new one of size_bytes on device, or the given uint8 buffer, wherever it lives, read as float32)."""
    if buffer is None:
        x = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    else:
        x = buffer[:buffer.numel() // 4 * 4].view(torch.float32)
    return x.numel() * 4 / _best(lambda: x.sum(), repeats, x.device)


def matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 7, device: torch.device | str = "cpu",
                 budget_s: float = 1.0) -> float:
    """Matrix-multiply FLOP/s of the device at dtype: best time of an n x n x n product, or, where the dtype
    is slow here, of the largest size (256 doubled) whose product takes under budget_s: bfloat16 on a CPU
    without its instructions runs at ~1 GFLOP/s, where one 2048 product would take half a minute."""
    size = min(n, 256)
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        t = _best(lambda: a @ b, 1, a.device)
        if size >= n or t * 8 > budget_s:  # the next size takes 8x as long
            break
        size = min(n, 2 * size)
    return 2 * size**3 / _best(lambda: a @ b, repeats, a.device)


def weight_bytes(model) -> int:
    """Bytes read per decoded token: every weight (float parameters and quantized blocks), the embedding
    only where it is also the output layer."""
    total = 0
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight" and model.lm_head is not None:
            total += p.shape[1] * p.element_size()  # one row looked up
        else:
            total += p.numel() * p.element_size()
    for name, m in model.named_modules():
        parts = getattr(m, "qparts", ())
        if name == "embed_tokens" and model.lm_head is not None:
            total += sum(w.nbytes // w.shape[0] for w in parts)  # one row looked up
        else:
            total += sum(w.nbytes for w in parts)
    return total


def kv_bytes_per_token(llm) -> int:
    """Bytes of K and V one token of context holds (read once per decoded token)."""
    from tokenmill.runner import kv_bytes_per_block

    return kv_bytes_per_block(llm.engine.model, 1, llm.engine.dtype, llm.engine.config.kv_cache_dtype)


def matmul_params(model) -> int:
    """Parameters in matrix multiplications per token (the output layer included)."""
    n = 0
    for name, p in model.named_parameters():
        if p.dim() == 2 and (name != "embed_tokens.weight" or model.lm_head is None):
            n += p.numel()
    for name, m in model.named_modules():
        if name != "embed_tokens" or model.lm_head is None:
            n += sum(w.shape[0] * w.shape[1] for w in getattr(m, "qparts", ()))
    return n


def decode_run(llm, context: int = 128, new_tokens: int = 128, seed: int = 0) -> float:
    """One batch-1 decode: tokens after the first over the time after the first token."""
    vocab = llm.engine.vocab_size
    prompt = [(1000 + 7 * j + seed) % vocab for j in range(context)]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    return (new_tokens - 1) / (m.finished_time - m.first_token_time)


def prefill_tokens_per_s(llm, prompt_len: int = 500, repeats: int = 5) -> float:
    vocab = llm.engine.vocab_size
    rates = []
    for i in range(repeats + 1):
        llm.engine.reset_prefix_cache()
        prompt = [(2000 + 13 * j + i) % vocab for j in range(prompt_len)]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        m = out.metrics
        if i:
            rates.append(prompt_len / (m.first_token_time - m.arrival_time))
    return statistics.median(rates)


def run_roofline(llm, context: int = 128, prompt_len: int = 500, repeats: int = 5) -> dict:
    engine = llm.engine
    if engine.tp is not None:  # the weights, bytes and bandwidth below would be rank 0's alone
        raise ValueError("the roofline is measured on one engine: run it with tensor_parallel_size 1")
    model = engine.model
    arena = getattr(model, "weight_arena", None)

    def bandwidth() -> float:
        # The faster of a fresh 1 GiB buffer and the model's own weight buffer (where the weights live
        # in one): the physical memory behind each can differ in speed.
        bw = memory_bandwidth(repeats=5, device=engine.device)
        return max(bw, memory_bandwidth(repeats=5, buffer=arena)) if arena is not None else bw

    bytes_per_token = weight_bytes(model) + kv_bytes_per_token(llm) * (context + 64)  # mid-generation context
    # A shared machine's bandwidth drifts, at times by half for minutes. Each decode run is measured
    # against the larger of the bandwidths measured just before and just after it; the share is the
    # median over runs. The share against the best bandwidth seen in the whole run is reported too.
    decode_run(llm, context, seed=0)  # warm-up
    bws, rates, shares = [bandwidth()], [], []
    for i in range(1, repeats + 1):
        rates.append(decode_run(llm, context, seed=i))
        bws.append(bandwidth())
        shares.append(rates[-1] * bytes_per_token / max(bws[-2], bws[-1]))
    decode = statistics.median(rates)
    # A GPU's matmul rate shows only on products large enough to fill it.
    n = 8192 if engine.device.type == "cuda" else 2048
    flops = matmul_flops(engine.dtype, n, device=engine.device)
    prefill = prefill_tokens_per_s(llm, prompt_len)
    flops = max(flops, matmul_flops(engine.dtype, n, device=engine.device))
    bw = max(bws)
    flops_per_token = 2 * matmul_params(model)
    return {
        "dtype": str(engine.dtype).removeprefix("torch."), "device": str(engine.device),
        "threads": torch.get_num_threads(),
        "memory_bandwidth_GBps": bw / 1e9, "memory_bandwidth_range_GBps": [min(bws) / 1e9, bw / 1e9],
        "matmul_GFLOPs": flops / 1e9,
        "decode_tokens_per_s": decode, "decode_bytes_per_token_MB": bytes_per_token / 1e6,
        "decode_achieved_GBps": decode * bytes_per_token / 1e9,
        "decode_roofline_tokens_per_s": bw / bytes_per_token,
        "decode_pct_of_roofline": 100 * statistics.median(shares),
        "decode_pct_of_roofline_runs": [100 * x for x in shares],
        "decode_pct_of_best_bandwidth": 100 * decode * bytes_per_token / bw,
        "prefill_tokens_per_s": prefill, "prefill_prompt_len": prompt_len,
        "prefill_achieved_GFLOPs": prefill * flops_per_token / 1e9,
        "prefill_roofline_tokens_per_s": flops / flops_per_token,
        "prefill_pct_of_roofline": 100 * prefill * flops_per_token / flops,
    }


def print_roofline(r: dict) -> None:
    low, high = r["memory_bandwidth_range_GBps"]
    where = f"{r['threads']} threads" if r["device"] == "cpu" else r["device"]
    print(f"machine: memory bandwidth {high:.1f} GB/s (lowest measured in this run {low:.1f}), {r['dtype']} "
          f"matmul {r['matmul_GFLOPs']:.0f} GFLOP/s ({where})")
    runs = ", ".join(f"{x:.0f}%" for x in r["decode_pct_of_roofline_runs"])
    print(f"decode (batch 1): {r['decode_tokens_per_s']:.1f} tok/s, {r['decode_bytes_per_token_MB']:.1f} MB read per "
          f"token -> {r['decode_achieved_GBps']:.1f} GB/s = {r['decode_pct_of_roofline']:.0f}% of the bandwidth "
          f"roofline (median of runs, each against the bandwidth measured around it: {runs}); "
          f"{r['decode_pct_of_best_bandwidth']:.0f}% of the best bandwidth seen "
          f"({r['decode_roofline_tokens_per_s']:.1f} tok/s)")
    print(f"prefill ({r['prefill_prompt_len']} tokens): {r['prefill_tokens_per_s']:.1f} tok/s -> "
          f"{r['prefill_achieved_GFLOPs']:.0f} GFLOP/s = {r['prefill_pct_of_roofline']:.0f}% of the matmul roofline "
          f"({r['prefill_roofline_tokens_per_s']:.0f} tok/s)")
