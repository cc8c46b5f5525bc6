"""Tensor parallelism: a model split over 2 ranks gives transformers' greedy tokens, in every scheduling mode;
the cuts reassemble the whole model; a dead rank fails the engine's call instead of hanging it; no rank
outlives its engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.conftest import ARCHS, PROMPTS, block_bytes, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.distributed.shard import Shard
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels import quant

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def assert_stopped(llm: LLM) -> None:
    """Shutting the engine down leaves no rank behind."""
    pids = llm.engine.tp.pids
    llm.engine.shutdown()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), "a tensor-parallel rank outlived its engine"


_reference: dict[str, list] = {}


def reference(folder: str, prompt_ids):
    if folder not in _reference:
        _reference[folder] = hf_greedy(folder, prompt_ids, MAX_NEW)[0]
    return _reference[folder]


def run_split(folder: str, **kwargs) -> tuple[LLM, list, list]:
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2, **kwargs)
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompt_ids, GREEDY)
    return llm, prompt_ids, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_split_model_matches_transformers(tiny_models, arch):
    """Every architecture split over 2 ranks: the batch's greedy tokens equal transformers' on the whole model,
    and each rank holds half of the heads."""
    folder = tiny_models[arch]
    llm, prompt_ids, tokens = run_split(folder)
    try:
        cfg = llm.engine.model.config
        assert cfg.num_kv_heads == 1 and llm.engine.tp.world == 2, "rank 0 should hold one of the 2 KV heads"
        assert tokens == reference(folder, prompt_ids)
        pool = llm.engine.kv_manager.pool
        assert pool.num_free == pool.num_blocks
    finally:
        assert_stopped(llm)


@pytest.mark.parametrize("arch, mode", [("llama", "chunked"), ("llama", "preempt"), ("llama", "prefix-hits"),
                                        ("gemma3", "chunked"), ("gemma3", "prefix-hits"), ("qwen2-moe", "preempt")])
def test_split_model_in_every_scheduling_mode(tiny_models, arch, mode):
    folder = tiny_models[arch]
    kwargs = {"chunked": {"max_num_batched_tokens": 7},
              # Each rank holds half the KV heads: 20 blocks of 4 tokens in half a block's bytes each.
              "preempt": {"block_size": 4, "kv_cache_memory": 20 * block_bytes(folder, 4) // 2},
              "prefix-hits": {"block_size": 4}}[mode]
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2, **kwargs)
    try:
        tok = llm.get_tokenizer()
        prompt_ids = [tok.encode(p) for p in PROMPTS]
        if mode == "prefix-hits":
            llm.generate(prompt_ids[5:6], GREEDY)
            prompt_ids = [prompt_ids[5][:n] + tok.encode(" fox") for n in (4, 9, 17)] + prompt_ids
        outs = llm.generate(prompt_ids, GREEDY)
        ref = hf_greedy(folder, prompt_ids, MAX_NEW)[0] if mode == "prefix-hits" else reference(folder, prompt_ids)
        assert [o.outputs[0].token_ids for o in outs] == ref
        engine = llm.engine
        if mode == "preempt":
            assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"
        if mode == "prefix-hits":
            assert engine.kv_manager.num_hit_tokens > 0
    finally:
        assert_stopped(llm)


def test_default_model_split_matches_transformers_and_one_rank(default_gguf):
    """The real default model (9 query and 3 KV heads: 1 and 2 KV heads a rank) over 2 ranks: weights
    dequantized, transformers' tokens; in the file's own block formats (cut in their blocks), the tokens of
    the same formats on one rank."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(default_gguf), os.path.basename(default_gguf)
    ref_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    split = LLM(dtype="float32", quantization="none", tensor_parallel_size=2, kv_cache_memory="64MiB")
    try:
        outs = split.generate(prompts, params)
    finally:
        assert_stopped(split)
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            ids = ref_tok(prompt, return_tensors="pt").input_ids
            ref = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 pad_token_id=ref_tok.eos_token_id)
            assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt

    # The file's own block formats: each rank's products quantize their inputs to 8 bits in blocks of 32,
    # and a sum in another order can round an input the other way, so the split model's numbers differ from
    # the whole one's by the formats' own noise, not bit for bit. Its prompt logprobs of a long text stay
    # within that noise of the whole model's (a cut in the wrong place would be far off).
    text = TEXT_FOR_LOGPROBS
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    whole = LLM(dtype="float32", kv_cache_memory="64MiB")
    expected = whole.generate(text, params)[0].prompt_logprobs[1:]
    split = LLM(dtype="float32", tensor_parallel_size=2, kv_cache_memory="64MiB")
    try:
        assert split.engine.model.quantized, "the split model should run the file's block formats"
        got = split.generate(text, params)[0].prompt_logprobs[1:]
    finally:
        assert_stopped(split)
    a = np.array([next(iter(lp.values())).logprob for lp in expected])
    b = np.array([next(iter(lp.values())).logprob for lp in got])
    assert len(a) > 60
    assert np.abs(a - b).mean() < 0.05, np.abs(a - b).mean()
    assert abs(a.mean() - b.mean()) < 0.01 * abs(a.mean())


TEXT_FOR_LOGPROBS = ("The history of the city begins with a small settlement on the river, where traders met to "
                     "exchange grain, salt and cloth. Over the centuries it grew into a market town, then a "
                     "regional capital with a cathedral, a university and a busy port. Today its old streets "
                     "draw visitors from around the world, who come for the museums, the food and the music.")


def test_split_model_samples_as_the_whole_one(tiny_models):
    """Seeded sampling (single steps, not bursts) draws the same tokens from the split float32 model."""
    folder = tiny_models["llama"]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16)
    whole = LLM(folder, dtype="float32")
    expected = [o.outputs[0].token_ids for o in whole.generate(PROMPTS, params)]
    split = LLM(folder, dtype="float32", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in split.generate(PROMPTS, params)] == expected
    finally:
        assert_stopped(split)


def test_a_dead_rank_fails_the_call_instead_of_hanging(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", tensor_parallel_size=2)
    try:
        llm.generate("The quick brown fox", GREEDY)
        os.kill(llm.engine.tp.pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank"):
            llm.generate("The quick brown fox", GREEDY)
        assert time.monotonic() - start < 10
    finally:
        assert_stopped(llm)


def test_ranks_die_with_their_engine_process(tiny_models):
    """A killed engine process takes its ranks with it."""
    code = ("import sys, time\nfrom tokenmill import LLM\n"
            f"llm = LLM({tiny_models['llama']!r}, dtype='float32', tensor_parallel_size=2)\n"
            "print(*llm.engine.tp.pids, flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(alive(p) for p in pids)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids), "a rank outlived its killed engine"
    finally:
        proc.kill()


# ---------------------------------------------------------------------------------------------- the cuts

SHARD = dict(num_heads=6, num_kv_heads=3, head_dim=8, intermediate=96, expert_intermediate=64,
             shared_intermediate=64, vocab=101)


def shards(world: int = 2) -> list[Shard]:
    return [Shard(rank, world, **SHARD) for rank in range(world)]


@pytest.mark.parametrize("name, shape, how", [
    ("layers.0.self_attn.q_proj.weight", (48, 20), "rows"),
    ("layers.0.self_attn.k_proj.bias", (24,), "rows"),
    ("layers.0.mlp.gate_proj.weight", (96, 20), "rows"),
    ("layers.0.self_attn.o_proj.weight", (20, 48), "cols"),
    ("layers.0.mlp.down_proj.weight", (20, 96), "cols"),
    ("embed_tokens.weight", (101, 20), "rows"),
    ("lm_head.weight", (101, 20), "rows"),
    ("layers.0.mlp.experts.3.up_proj.weight", (64, 20), "rows"),
    ("layers.0.mlp.experts.down_proj.weight", (4, 20, 64), "cols"),
    ("layers.0.mlp.shared_expert.down_proj.weight", (20, 64), "cols"),
    ("layers.0.input_layernorm.weight", (20,), "whole"),
    ("layers.0.mlp.gate.weight", (4, 20), "whole"),
])
def test_the_ranks_cuts_reassemble_the_tensor(name, shape, how):
    t = torch.randn(shape)
    parts = [s.float_tensor(name, t) for s in shards()]
    if how == "whole":
        assert all(torch.equal(p, t) for p in parts)
    else:
        assert torch.equal(torch.cat(parts, dim=-1 if how == "cols" else 0), t)
        assert parts[0].numel() < t.numel()


def test_merged_projections_and_stacked_experts_cut_each_part():
    qkv = torch.randn(48 + 24 + 24, 20)
    parts = [s.float_tensor("layers.0.self_attn.qkv_proj.weight", qkv) for s in shards()]
    # rank 0 holds KV head 0 (query heads 0-1), rank 1 KV heads 1-2 (query heads 2-5)
    assert torch.equal(parts[0], torch.cat([qkv[0:16], qkv[48:56], qkv[72:80]]))
    assert torch.equal(parts[1], torch.cat([qkv[16:48], qkv[56:72], qkv[80:96]]))
    experts = torch.randn(4, 64, 20)
    parts = [s.float_tensor("layers.0.mlp.experts.gate_proj.weight", experts) for s in shards()]
    assert torch.equal(torch.cat(parts, dim=1), experts)


def test_row_parallel_bias_is_added_once():
    b = torch.randn(20)
    parts = [s.float_tensor("layers.0.self_attn.o_proj.bias", b) for s in shards()]
    assert torch.equal(parts[0], b) and torch.equal(parts[1], torch.zeros(20))


def test_block_format_cuts_are_the_cuts_of_the_values():
    """A Q8_0 matrix cut in its blocks (rows and columns) holds exactly the values of the cut float matrix."""
    if quant.load() is None:
        pytest.skip("no quantized-weight kernels")
    g = torch.randn(20, 3, 32)  # GGUF's Q8_0 blocks: a float16 scale, then 32 int8 codes
    d = (g.abs().amax(-1, keepdim=True) / 127).half()
    codes = (g / d.float()).round().clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([d.view(torch.uint8).reshape(20, 3, 2), codes.view(torch.uint8)], -1).reshape(20, -1).numpy()
    whole = quant.QuantizedWeight.from_blocks(8, (20, 96), torch.from_numpy(blocks.copy())).dequantize()
    for s in shards():
        rows, shape = s.block_rows("layers.0.mlp.down_proj.weight", blocks, (20, 96), 32, 34)
        part = quant.QuantizedWeight.from_blocks(8, shape, torch.from_numpy(rows))
        lo, hi = s._part("i")
        assert torch.equal(part.dequantize(), whole[:, lo:hi])
    assert not Shard(0, 2, **{**SHARD, "intermediate": 64 + 32 * 3}).splits_blocks(
        "layers.0.mlp.down_proj.weight", (20, 160), 256)


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="key/value heads"):
        Shard.of({"num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 64, "intermediate_size": 128,
                  "vocab_size": 100}, 0, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("nowhere", tensor_parallel_size=0)


def test_vocab_slices_cover_the_vocabulary_once():
    ranges = [s.vocab_range for s in shards(3)]
    assert ranges[0][0] == 0 and ranges[-1][1] == 101
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert np.diff([r[1] - r[0] for r in ranges[:-1]]).max(initial=0) == 0


def rank_pids(parent: int) -> list[int]:
    """The tensor-parallel ranks a process started."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().split(")")[-1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if ppid == parent and b"tokenmill.distributed.worker" in cmd:
                pids.append(int(entry))
    return pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_server_with_a_split_model(tiny_models, sig):
    """`tokenmill serve --tensor-parallel-size 2` answers the openai client as the whole model does, and its
    ranks end with it, whether it is stopped or killed."""
    import openai

    from tests.server_utils import ServerProcess

    folder = tiny_models["llama"]
    expected = LLM(folder, dtype="float32").generate(PROMPTS[0], GREEDY)[0].outputs[0].text
    server = ServerProcess(folder, "--dtype", "float32", "--tensor-parallel-size", "2", "--served-model-name", "tiny")
    try:
        ranks = rank_pids(server.proc.pid)
        assert len(ranks) == 1
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        done = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0,
                                         extra_body={"min_tokens": MAX_NEW})
        assert done.choices[0].text == expected
    finally:
        server.stop(sig)
    deadline = time.monotonic() + 10
    while alive(ranks[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(ranks[0]), "the rank outlived its server"


def test_mlp_rows_split_on_the_files_blocks():
    c = dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, intermediate_size=1536, vocab_size=49152)
    assert [Shard.of(c, r, 2)._part("i") for r in range(2)] == [(0, 768), (768, 1536)]
    assert [Shard.of(c, r, 2)._part("kv") for r in range(2)] == [(0, 64), (64, 192)]
    # 1280 rows: 40 units of 32 split evenly, but a K-format file's down projection in whole 256-element blocks.
    c["intermediate_size"] = 1280
    assert Shard.of(c, 0, 2)._part("i") == (0, 640)
    assert Shard.of(c, 0, 2, granule=256)._part("i") == (0, 512)


TORCHRUN_SCRIPT = """
import json, sys
from tokenmill import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2)
# Only rank 0 gets here: the other rank serves it from inside LLM() and exits when it stops.
ids = json.loads(sys.argv[2])
outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), type(llm.engine.tp.group).__name__, flush=True)
llm.engine.shutdown()
"""


@pytest.mark.parametrize("hosts", [1, 2])
def test_ranks_started_by_torchrun(tiny_models, tmp_path, hosts):
    """torchrun's ranks over 127.0.0.1, as one host (shared memory) or as two (each torchrun a 'node' of one
    rank: gloo), give transformers' tokens; every rank exits when rank 0 stops."""
    import json

    from tests.server_utils import free_port

    folder = tiny_models["qwen3"]
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    prompt_ids = [tok.encode(p) for p in PROMPTS[:3]]
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1", "--master-port", port]
    if hosts == 1:
        cmds = [torchrun + ["--nnodes", "1", "--nproc-per-node", "2"]]
    else:
        cmds = [torchrun + ["--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1"] for n in range(2)]
    procs = [subprocess.Popen(c + [str(script), folder, json.dumps(prompt_ids)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for c in cmds]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), logs
    line = next(ln for log in logs for ln in log.splitlines() if ln.startswith("TOKENS"))
    tokens, kind = line.split(" ", 1)[1].rsplit(" ", 1)
    assert kind == ("ShmGroup" if hosts == 1 else "TorchGroup")
    assert json.loads(tokens) == hf_greedy(folder, prompt_ids, 16)[0]


def test_shared_memory_group_sums_gathers_and_carries_large_messages():
    """Two ranks of a ShmGroup (threads here): sums equal on both, in rank order; gathers in rank order; a
    message larger than the message area arrives whole, after a small one."""
    import threading

    from tokenmill.distributed.group import SHM_MESSAGE_BYTES, ShmGroup

    zero = ShmGroup.create(2, for_children=False)
    one = ShmGroup.attach(zero.path, 1, 2)
    zero.unlink()
    x = [torch.randn(3000) for _ in range(2)]
    got: dict = {}

    def rank1():
        got["sum"] = one.all_reduce(x[1].clone())
        got["gather"] = one.all_gather(torch.full((5,), 1.0))
        got["small"] = one.recv()
        got["big"] = one.recv()

    t = threading.Thread(target=rank1)
    t.start()
    mine = zero.all_reduce(x[0].clone())
    gathered = zero.all_gather(torch.full((5,), 0.0))
    big = np.arange(SHM_MESSAGE_BYTES // 4, dtype=np.int64)  # twice the message area
    zero.send(("small", 1))
    zero.send(("big", big))
    t.join(30)
    assert not t.is_alive()
    assert torch.equal(mine, got["sum"]) and torch.equal(mine, x[0] + x[1])
    assert torch.equal(gathered, got["gather"]) and gathered[:, 0].tolist() == [0.0, 1.0]
    assert got["small"] == ("small", 1) and np.array_equal(got["big"][1], big)
    zero.close()
    assert one.recv() is None  # a closed group answers at once


def test_a_switch_set_on_rank_0s_model_reaches_every_rank(tiny_models):
    """use_fused_decode set on the engine's model reaches the other rank too (else rank 0 would run module by
    module while rank 1 ran the fused step, and their sums would never meet)."""
    folder = tiny_models["llama"]
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2)
    try:
        llm.engine.model.use_fused_decode = False
        tok = llm.get_tokenizer()
        prompt_ids = [tok.encode(p) for p in PROMPTS]
        outs = llm.generate(prompt_ids, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference(folder, prompt_ids)
    finally:
        assert_stopped(llm)


def test_speculative_decoding_on_a_split_model(tiny_models):
    """Proposals (transformers' own continuation, one token in three spoiled) verified by the split model,
    several query rows a request through the fused step on every rank, keep transformers' greedy tokens;
    some are accepted, some rejected."""
    from tests.test_spec_decode import Oracle

    folder = tiny_models["llama"]
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        tok = llm.get_tokenizer()
        prompt_ids = [tok.encode(p) for p in PROMPTS]
        ref = reference(folder, prompt_ids)
        llm.engine.proposer = Oracle({tuple(i): r for i, r in zip(prompt_ids, ref)}, llm.engine.vocab_size)
        llm.engine.spec_rows = 64
        outs = llm.generate(prompt_ids, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref
        stats = llm.engine.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        assert_stopped(llm)


@pytest.fixture(scope="module")
def wide_experts(tmp_path_factory) -> dict[str, str]:
    """Mixture-of-experts models whose experts (64 rows: 32 a rank) still fit the fused decode step when
    split over 2 ranks: Qwen2-MoE (shared expert, a dense middle layer), Mixtral (a window of 24) and gpt-oss
    (biases, the down bias on rank 0 only; sinks)."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    from tests.conftest import gpt_oss_config, save_tiny_models

    def configs(vocab: int) -> dict:
        common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=0)
        return {
            "qwen2-moe": Qwen2MoeConfig(**{**common, "num_hidden_layers": 3}, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                        norm_topk_prob=False, mlp_only_layers=[1]),
            "mixtral": MixtralConfig(**{**common, "intermediate_size": 64}, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=24),
            "gpt-oss": gpt_oss_config(common, intermediate_size=64),
        }

    return save_tiny_models(tmp_path_factory.mktemp("wide-experts"), configs)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the CPU kernels")
@pytest.mark.parametrize("arch", ["qwen2-moe", "mixtral", "gpt-oss"])
def test_experts_split_over_ranks_run_in_the_fused_step(wide_experts, arch):
    """Each rank's part of every expert (and of the shared expert) runs in the fused decode step, summed over
    the group before it joins the residual, in single steps and in steps of more requests than one parallel
    region takes (the batched path): the greedy tokens stay transformers'."""
    folder = wide_experts[arch]
    llm, prompt_ids, tokens = run_split(folder)
    try:
        fused = llm.engine.model.built_fused_decoder()
        assert fused is not None and fused.team_stats()[0] > 0, "decode steps should have run fused"
        assert tokens == reference(folder, prompt_ids)
        if llm.engine.runner.governor is None:  # ranks of one thread each: a team's governor, as on larger hosts
            llm.engine.runner.governor = cpu_kernels.ThreadGovernor(2)
        assert llm.engine.stats()["cpu_decode_calls_on_one_thread"] == fused.team_stats()[1]
        many = [ids[:n] for n in (3, 5, 8) for ids in prompt_ids][:12]  # past the MoE team's 8 rows
        outs = llm.generate(many, SamplingParams(temperature=0, max_tokens=6, min_tokens=6))
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, many, 6)[0]
    finally:
        assert_stopped(llm)
