"""Attention over the paged KV cache on a GPU: the Triton kernels (attention/triton_paged.py) against the
default backend's torch operators (a gather through the block tables, then batched matmuls; a prompt chunk
through scaled_dot_product_attention), each checked against the other before it is timed.

    python benchmarks/gpu_attention.py [--batches 1 8 64 256] [--contexts 512 4096] [--prompt 4096]

Decode: one query token per request, every request at the same context length, blocks scattered through
the pool; reported as microseconds a layer and the KV bytes read over that time (GB/s). Prompt: one chunk of
--prompt tokens, causal, reported as TFLOP/s (4 * tokens^2 / 2 * heads * head_dim flops). Medians of --iters
timed calls after a warm-up, CUDA events. --smoke runs tiny shapes on the CPU under Triton's interpreter,
to check the script itself where no GPU is present.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    args = p.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.batches, args.contexts, args.prompt, args.iters = [1, 3], [40], 48, 2
        args.heads, args.kv_heads, args.head_dim = 4, 2, 32

    import torch

    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.attention.cpu import TorchSDPABackend
    from tokenmill.attention.triton_paged import TritonPagedBackend, paged_attention

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    bs, h, kvh, d = args.block_size, args.heads, args.kv_heads, args.head_dim
    torch_backend, triton_backend = TorchSDPABackend(), TritonPagedBackend()

    def timed(fn) -> float:
        """Median microseconds of fn()."""
        fn()
        times = []
        for _ in range(args.iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                import time

                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e6)
        return statistics.median(times)

    def caches(num_blocks: int):
        k = torch.randn(num_blocks * bs, kvh, d, device=device, dtype=dtype)
        return k, torch.randn_like(k)

    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (interpreter)'}; "
          f"heads {h}, KV heads {kvh}, head_dim {d}, block {bs}, {dtype}")
    print("decode: batch, context, torch us, triton us, torch GB/s, triton GB/s, triton/torch speed")
    for ctx in args.contexts:
        per = -(-ctx // bs)
        for batch in args.batches:
            k_cache, v_cache = caches(batch * per + 1)
            tables = torch.randperm(batch * per, device=device).view(batch, per) + 1
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(batch, dtype=torch.long, device=device),
                query_start_loc=list(range(batch + 1)), seq_lens=[ctx] * batch, num_decodes=batch,
                decode_block_tables=tables, decode_seq_lens=torch.full((batch,), ctx, device=device),
                block_tables=[None] * batch, block_size=bs)
            q = torch.randn(batch, h, d, device=device, dtype=dtype)
            scale = d ** -0.5

            def run_torch():
                meta.cache.clear()
                return torch_backend._decode(q, k_cache, v_cache, meta, scale, None)

            def run_triton():
                meta.cache.clear()
                return paged_attention(q, k_cache, v_cache, meta, scale, None)

            torch.testing.assert_close(run_triton().float(), run_torch().float(), atol=2e-2, rtol=2e-2)
            a, b = timed(run_torch), timed(run_triton)
            kv_bytes = 2 * batch * ctx * kvh * d * k_cache.element_size()
            print(f"  {batch:4d} {ctx:6d} {a:10.1f} {b:10.1f} {kv_bytes / a / 1e3:9.1f} {kv_bytes / b / 1e3:9.1f} "
                  f"{a / b:6.2f}x", flush=True)

    n = args.prompt
    per = -(-n // bs)
    k_cache, v_cache = caches(per + 1)
    table = torch.randperm(per, device=device) + 1
    pos = torch.arange(n, device=device)
    slots = table[pos // bs] * bs + pos % bs
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=[0, n], seq_lens=[n], num_decodes=0,
                             decode_block_tables=None, decode_seq_lens=None, block_tables=[table], block_size=bs)
    q = torch.randn(n, h, d, device=device, dtype=dtype)
    k, v = torch.randn(n, kvh, d, device=device, dtype=dtype), torch.randn(n, kvh, d, device=device, dtype=dtype)

    def prompt(backend):
        def run():
            meta.cache.clear()
            return backend.forward(q, k, v, k_cache, v_cache, meta, d ** -0.5, None)
        return run

    torch.testing.assert_close(prompt(triton_backend)().float(), prompt(torch_backend)().float(), atol=2e-2, rtol=2e-2)
    a, b = timed(prompt(torch_backend)), timed(prompt(triton_backend))
    flops = 4 * n * n / 2 * h * d
    print(f"prompt of {n} tokens: torch {a:.1f} us ({flops / a / 1e6:.1f} TFLOP/s), triton {b:.1f} us "
          f"({flops / b / 1e6:.1f} TFLOP/s), triton/torch speed {a / b:.2f}x")


if __name__ == "__main__":
    main()
