"""The Triton paged-attention kernels (tokenmill/attention/triton_paged.py), run by Triton's interpreter on
the CPU: every row of a mixed batch (decodes, verify rows, prompt chunks over a cached prefix) against a
float64 attention over the same cache, with grouped heads, windows, soft caps, sink logits, 8-bit caches
and the split key ranges of flash-decoding; and the engine with this backend against the default one."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")

from tokenmill.attention import kv_format  # noqa: E402
from tokenmill.attention.backend import AttentionMetadata  # noqa: E402
from tokenmill.attention.triton_paged import num_splits_for, paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(requests, kv_heads, head_dim, block_size, dtype, kv_dtype="auto", seed=0):
    """requests: (new tokens, context length after the step) per request, decodes (1 new token) first.
    Returns (meta, k cache, v cache, float64 keys and values per request as the caches hold them)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [-(-ctx // block_size) for _, ctx in requests]
    num_blocks = sum(blocks_per) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered through the pool
    slots = num_blocks * block_size

    def new_tensor(shape, dt):
        return torch.zeros(shape, dtype=dt, device=DEVICE)

    k_cache = kv_format.new_cache(kv_dtype, slots, kv_heads, head_dim, dtype, new_tensor)
    v_cache = kv_format.new_cache(kv_dtype, slots, kv_heads, head_dim, dtype, new_tensor)
    tables, dense = [], []
    for (n, ctx), nb in zip(requests, blocks_per):
        table = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.long, device=DEVICE)
        pos = torch.arange(ctx, device=DEVICE)
        req_slots = table[pos // block_size] * block_size + pos % block_size
        k = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
        v = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
        kv_format.write(k_cache, req_slots, k)
        kv_format.write(v_cache, req_slots, v)
        dense.append((kv_format.read(k_cache, req_slots, torch.float32).double(),
                      kv_format.read(v_cache, req_slots, torch.float32).double()))
        tables.append(table)
    counts = [n for n, _ in requests]
    qsl = [0]
    for c in counts:
        qsl.append(qsl[-1] + c)
    nd = 0
    while nd < len(counts) and counts[nd] == 1:
        nd += 1
    width = max((len(t) for t in tables[:nd]), default=0)
    dbt = torch.zeros(nd, width, dtype=torch.long, device=DEVICE) if nd else None
    for i in range(nd):
        dbt[i, :len(tables[i])] = tables[i]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long, device=DEVICE), query_start_loc=qsl,
        seq_lens=[ctx for _, ctx in requests], num_decodes=nd, decode_block_tables=dbt,
        decode_seq_lens=torch.tensor([ctx for _, ctx in requests[:nd]], device=DEVICE) if nd else None,
        block_tables=tables, block_size=block_size)
    return meta, k_cache, v_cache, dense


def reference(q, requests, dense, scale, window, softcap, sinks):
    """float64 attention of each request's query rows over its keys and values."""
    out = torch.empty(q.shape, dtype=torch.float64)
    h = q.shape[1]
    start = 0
    for (n, ctx), (k, v) in zip(requests, dense):
        qr = q[start:start + n].double().cpu()
        kvh = k.shape[1]
        k, v = k.cpu().repeat_interleave(h // kvh, dim=1), v.cpu().repeat_interleave(h // kvh, dim=1)
        scores = torch.einsum("thd,lhd->htl", qr, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(ctx - n, ctx).unsqueeze(1)
        kpos = torch.arange(ctx).unsqueeze(0)
        ok = kpos <= qpos
        if window is not None:
            ok &= kpos > qpos - window
        scores = scores.masked_fill(~ok, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().cpu().view(h, 1, 1).expand(h, n, 1)], dim=-1)
        probs = scores.softmax(-1)
        if sinks is not None:
            probs = probs[..., :-1]
        out[start:start + n] = torch.einsum("htl,lhd->thd", probs, v)
        start += n
    return out


MIXED = [(1, 37), (1, 130), (1, 5), (4, 70), (19, 19), (23, 151)]  # 3 decodes, a verify, a prompt, a chunk


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (6, 2, 64), (8, 2, 80)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_batch_matches_float64(heads, kv_heads, head_dim, num_splits):
    """Decode rows, speculative verify rows, a whole prompt and a chunk over a cached prefix in one call;
    head_dim 80 is not a power of two (masked columns), groups of 1, 3 and 4 heads per KV head."""
    meta, kc, vc, dense = make_batch(MIXED, kv_heads, head_dim, 16, torch.float32)
    q = torch.randn(meta.query_start_loc[-1], heads, head_dim, device=DEVICE)
    scale = head_dim ** -0.5
    out = paged_attention(q, kc, vc, meta, scale, None, num_splits=num_splits)
    ref = reference(q, MIXED, dense, scale, None, None, None)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("feature", ["window", "softcap", "sinks", "all"])
def test_windows_softcaps_and_sinks(feature, num_splits):
    window = 24 if feature in ("window", "all") else None
    softcap = 3.0 if feature in ("softcap", "all") else None
    sinks = torch.randn(6, device=DEVICE) if feature in ("sinks", "all") else None
    requests = [(1, 100), (1, 9), (5, 61), (40, 90)]
    meta, kc, vc, dense = make_batch(requests, 2, 32, 8, torch.float32, seed=1)
    q = 2 * torch.randn(meta.query_start_loc[-1], 6, 32, device=DEVICE)  # large logits: the cap matters
    out = paged_attention(q, kc, vc, meta, 0.3, window, softcap, sinks, num_splits=num_splits)
    ref = reference(q, requests, dense, 0.3, window, softcap, sinks)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eight_bit_caches_are_read_in_place(kv_dtype, dtype):
    """Codes times each slot's scale, as kv_format reads them back; bfloat16 rows within bfloat16's
    rounding of the probabilities and inputs."""
    requests = [(1, 50), (1, 200), (3, 33), (12, 40)]
    meta, kc, vc, dense = make_batch(requests, 2, 64, 16, dtype, kv_dtype, seed=2)
    assert isinstance(kc, kv_format.KVCache)
    q = torch.randn(meta.query_start_loc[-1], 4, 64, device=DEVICE).to(dtype)
    for splits in (1, 2):
        out = paged_attention(q, kc, vc, meta, 0.125, None, num_splits=splits)
        ref = reference(q, requests, dense, 0.125, None, None, None)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


def test_decode_only_steps_read_the_decode_tensors():
    """A decode-only step (the CUDA graphs' case) reads decode_block_tables and decode_seq_lens, not the
    per-request lists: the graphs' metadata carries placeholders there."""
    requests = [(1, 300), (1, 17), (1, 64)]
    meta, kc, vc, dense = make_batch(requests, 1, 16, 16, torch.float32, seed=3)
    meta.block_tables = [None] * 3
    meta.seq_lens = [1, 1, 1]
    q = torch.randn(3, 2, 16, device=DEVICE)
    out = paged_attention(q, kc, vc, meta, 0.25, None)
    torch.testing.assert_close(out.double().cpu(), reference(q, requests, dense, 0.25, None, None, None),
                               atol=2e-5, rtol=1e-5)


def test_splits_only_where_tiles_are_fewer_than_the_multiprocessors():
    assert num_splits_for(programs=256, max_context=4096, multiprocessors=132) == 1
    assert num_splits_for(programs=8, max_context=4096, multiprocessors=132) == 16
    assert num_splits_for(programs=8, max_context=256, multiprocessors=132) == 2
    assert num_splits_for(programs=8, max_context=64, multiprocessors=132) == 1


# The engine with TOKENMILL_ATTENTION_BACKEND=triton: greedy tokens as transformers' (float32), in each
# scheduling mode on llama (grouped heads); with verify rows (and so decodes and prompts) on architectures
# with sliding windows and soft caps (gemma2), windows on some layers (gemma3) and sink logits (gpt-oss).
ENGINE_MODES = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 7},
    "preempt": {"block_size": 4, "kv_cache_blocks": 20},
    "verify": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "graph-buffers": {},
}


ENGINE_CASES = [("llama", mode) for mode in ENGINE_MODES] + [(a, "verify") for a in ("gemma2", "gemma3", "gpt-oss")]


@pytest.mark.parametrize("arch,mode", ENGINE_CASES)
def test_engine_with_triton_attention_matches_transformers(tiny_models, arch, mode, monkeypatch):
    from tests.conftest import PROMPTS, block_bytes
    from tests.test_reference import MAX_NEW, reference
    from tokenmill import LLM, SamplingParams
    from tokenmill.attention.triton_paged import TritonPagedBackend

    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "triton")
    folder = tiny_models[arch]
    kwargs = dict(ENGINE_MODES[mode])
    if "kv_cache_blocks" in kwargs:
        kwargs["kv_cache_memory"] = kwargs.pop("kv_cache_blocks") * block_bytes(folder, kwargs["block_size"])
    llm = LLM(folder, dtype="float32", seed=0, device=DEVICE, enforce_eager=mode != "graph-buffers", **kwargs)
    engine = llm.engine
    backends = {type(m.backend) for m in engine.model.modules() if hasattr(m, "backend")}
    assert backends == {TritonPagedBackend}
    if DEVICE == "cpu":  # the module-by-module path: the CPU's fused decode step computes attention itself
        engine.model.use_fused_decode = False
        engine.runner.supports_bursts = False
        if mode == "graph-buffers":  # decode steps through the CUDA graphs' padded buffers, run eagerly
            engine.runner.decode_graphs = engine.runner.new_decode_graphs(capture=False)
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    ref_tokens, _ = reference(folder, prompt_ids)
    if mode == "verify":  # several query rows per request: proposals of transformers' tokens, some spoilt
        from tests.test_spec_decode import Oracle, _always_proposing

        _always_proposing(llm)
        engine.spec_rows = 64
        engine.proposer = Oracle({tuple(i): r for i, r in zip(prompt_ids, ref_tokens)}, engine.vocab_size)
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW))
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref_tokens[i], f"prompt {i} differs from transformers"
    if mode == "preempt":
        assert engine.scheduler.num_preemptions > 0
    if mode == "verify":  # verify rows ran, and most proposals were taken
        stats = engine.spec_stats
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > stats.num_draft_tokens / 2
    pool = engine.kv_manager.pool
    assert pool.num_free == pool.num_blocks


def test_an_unknown_attention_backend_is_refused(tiny_models, monkeypatch):
    from tokenmill import LLM

    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="TOKENMILL_ATTENTION_BACKEND must be one of torch, triton, got 'flash'"):
        LLM(tiny_models["llama"], dtype="float32")


def test_the_triton_backend_on_the_cpu_needs_the_interpreter(monkeypatch):
    from tokenmill.attention.backend import new_backend

    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA GPUs"):
        new_backend(torch.device("cpu"))
