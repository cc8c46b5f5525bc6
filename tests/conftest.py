"""Fixtures: tiny random models of every supported architecture, saved as Hugging Face folders."""

from __future__ import annotations

import json
import os

import pytest
import torch

TEXT = """The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n
Once upon a time there was a small engine that computed tokens. It batched many requests together,
kept their keys and values in blocks, and never lost a request. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
Ünïcödé: café, naïve, 日本語, emoji 🙂 and symbols #$%&*()[]{}<>?!
"""

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time there was a small engine that computed tokens. It batched many",
    "Numbers: 0 1 2 3",
    "A",
    "kept their keys and values in blocks, and never lost a request. The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(",
    "Ünïcödé: café, naïve, 日本語",
]


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (some results are known to differ there: see the tests that ask)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


def make_tokenizer(folder: str):
    """A byte-level BPE tokenizer trained on a small text, saved with special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)
    return hf


def _configs(vocab: int):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    # Gemma 3: two local layers (a window of 8, shorter than most prompts) then a global one whose rope is
    # scaled; q has more columns than the hidden size; the attention scale differs from head_dim's; and
    # sqrt(96) is not a bfloat16 number (the embedding scale is rounded as the reference rounds it).
    gemma = dict(common, hidden_size=96, head_dim=32, num_hidden_layers=3, sliding_window=8,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                 rope_scaling={"rope_type": "linear", "factor": 2.0})
    return {
        "llama": LlamaConfig(**common, rope_theta=10000.0),
        **phi3_configs(common),
        "llama3-tied": LlamaConfig(**common, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "mistral": MistralConfig(**common, sliding_window=24),
        "qwen2": Qwen2Config(**common),
        "qwen3": Qwen3Config(**common, head_dim=32),
        "gemma3": Gemma3TextConfig(**gemma),
        # Softcaps small enough to bend these tiny models' attention and output logits.
        "gemma2": Gemma2Config(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=20,
                               attn_logit_softcapping=1.0, final_logit_softcapping=1.5),
        **moe_configs(common),
    }


def moe_configs(common: dict) -> dict:
    """Mixtral (a window of 24), Qwen2-MoE (shared expert, top-k weights not renormalised, a dense middle layer)
    and Qwen3-MoE (top-k weights renormalised): 8 experts of 32 rows, 2 a token."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    return {
        "mixtral": MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2,
                                 sliding_window=24),
        "qwen2-moe": Qwen2MoeConfig(**{**common, "num_hidden_layers": 3}, **experts, shared_expert_intermediate_size=64,
                                    norm_topk_prob=False, mlp_only_layers=[1]),
        "qwen3-moe": Qwen3MoeConfig(**common, **experts, head_dim=32, norm_topk_prob=True),
        "gpt-oss": gpt_oss_config(common),
    }


def gpt_oss_config(common: dict, **overrides):
    """gpt-oss: 8 experts of 32 rows, 2 a token, with biases; attention sinks; three layers, sliding (a window
    of 8), full, sliding; YaRN rope whose original context (32) most prompts and generations pass; a clamp
    (0.5) that these small activations reach."""
    from transformers import GptOssConfig

    settings = dict(common, intermediate_size=32, num_hidden_layers=3, head_dim=16, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.5,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})
    return GptOssConfig(**{**settings, **overrides})


def phi3_configs(common: dict) -> dict:
    """Phi-3 with LongRoPE and a sliding window, and a Phi-4-mini-like one (partial rotary, tied embeddings).

    The switch from short to long rope factors (original_max_position_embeddings 24) lies inside two of the
    test prompts (37 and 46 tokens), and inside the generated tokens of the others; the factors
    differ enough from each other, and across frequencies, that a token rotated with the wrong set changes
    the greedy tokens."""
    from transformers import Phi3Config

    def longrope(dims: int, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {"rope_type": "longrope", "short_factor": (1 + torch.rand(dims // 2, generator=g)).tolist(),
                "long_factor": (4 + 30 * torch.rand(dims // 2, generator=g)).tolist()}

    phi = dict(common, original_max_position_embeddings=24)
    return {
        "phi3": Phi3Config(**phi, sliding_window=20, rope_scaling=longrope(16, 1)),
        # head_dim 16, of which 12 rotate.
        "phi4-mini": Phi3Config(**phi, partial_rotary_factor=0.75, tie_word_embeddings=True,
                                rope_scaling=longrope(12, 2)),
    }


ARCHS = ["llama", "llama3-tied", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi4-mini", "mixtral",
         "qwen2-moe", "qwen3-moe", "gpt-oss"]
MOE_ARCHS = ["mixtral", "qwen2-moe", "qwen3-moe", "gpt-oss"]


def save_tiny_models(root, configs) -> dict[str, str]:
    """Random-weight models of the given configs (a function of the vocabulary size), each saved with the
    small tokenizer as a folder under root; folder path per name."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer(str(root / "tokenizer"))
    paths = {}
    for name, cfg in configs(len(tok)).items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if cfg.model_type.startswith("gemma"):
            # Gemma's norms start at w = 0 (a scale of 1 + 0): random ones exercise the (1 + w) arithmetic.
            with torch.no_grad():
                for param_name, p in model.named_parameters():
                    if param_name.endswith("norm.weight"):
                        p.normal_(0.0, 0.5)
        if cfg.model_type == "gpt_oss":
            # Its biases start at zero (router's aside): random ones exercise every bias's place.
            with torch.no_grad():
                for param_name, p in model.named_parameters():
                    if param_name.endswith("bias"):
                        p.normal_(0.0, 0.2)
        folder = str(root / name)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        paths[name] = folder
    return paths


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Folder path per architecture name."""
    return save_tiny_models(tmp_path_factory.mktemp("tiny"), _configs)


@pytest.fixture(scope="session")
def default_gguf() -> str:
    """The real default model (fetched into the cache on first use)."""
    from tokenmill.model.hub import pull

    return pull()


def block_bytes(folder: str, block_size: int) -> int:
    """Bytes of one float32 KV block of the model in folder."""
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * block_size * c["num_key_value_heads"] * head_dim * 4


def reference_model(folder: str):
    """transformers' model of a folder in float32: with eager attention for Gemma and gpt-oss, the implementation that
    applies its attention softcapping."""
    from transformers import AutoModelForCausalLM

    with open(os.path.join(folder, "config.json")) as f:
        eager = json.load(f).get("model_type", "").startswith(("gemma", "gpt_oss"))
    kwargs = {"attn_implementation": "eager"} if eager else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


def teacher_forced_gaps(folder: str, prompts: list[list[int]], outs) -> list[float]:
    """For each generated token of each output, how far below transformers' float32 best choice (teacher-forced
    on the prompt and the tokens before it) its logprob is: 0 where it is that choice."""
    ref = reference_model(folder)
    gaps = []
    for ids, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        with torch.no_grad():
            lps = teacher_forced_logits(ref, ids + gen).float().log_softmax(-1)
        gaps += [float(lps[len(ids) + j - 1].max() - lps[len(ids) + j - 1][t]) for j, t in enumerate(gen)]
    return gaps


def teacher_forced_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), vocab] at each position of a sequence as its generate() computes them.
    A LongRoPE model rotates a sequence of up to original_max_position_embeddings tokens with short factors
    and a longer one with long factors throughout (generate() recomputes a sequence that grows past it), so
    its positions below that length come from a pass over the tokens up to it."""
    rope = model.config.rope_parameters or {}
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0]
        switch = rope.get("original_max_position_embeddings")
        if rope.get("rope_type") == "longrope" and switch < len(ids):
            logits[:switch] = model(torch.tensor([ids[:switch]], device=model.device)).logits[0]
    return logits


def teacher_forced_scores(llm, ref, prompts, tokens: int = 16):
    """Greedy runs of `tokens` tokens against transformers' model ref, teacher-forced on our tokens: the prompt
    logprobs' largest error, and per decoded token its gap to the reference's top choice and its logprob
    error (arrays)."""
    import numpy as np

    from tokenmill import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0,
                                                prompt_logprobs=1, logprobs=1), use_tqdm=False)
    prompt_err, gaps, errors = 0.0, [], []
    for ids, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        with torch.no_grad():
            want = ref(torch.tensor([ids + gen])).logits[0].log_softmax(-1)
        for i, t in enumerate(ids[1:], start=1):
            prompt_err = max(prompt_err, abs(out.prompt_logprobs[i][t].logprob - want[i - 1, t].item()))
        for j, t in enumerate(gen):
            row = want[len(ids) + j - 1]
            gaps.append(float(row.max() - row[t]))
            errors.append(abs(out.outputs[0].logprobs[j][t].logprob - float(row[t])))
    return prompt_err, np.array(gaps), np.array(errors)


def hf_greedy(folder: str, prompts: list[list[int]], max_new_tokens: int):
    """Reference: transformers' greedy generate of each prompt alone, plus last-position logprobs."""
    model = reference_model(folder)
    tokens, logprobs = [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            tokens.append(out[0, len(ids):].tolist())
            logprobs.append(model(x).logits[0, -1].float().log_softmax(-1))
    return tokens, logprobs


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def assert_channel_format_matches(llm, ref, weight_class, arch: str, device: str, tolerance: float) -> None:
    """A model loaded in a per-channel weight format (FP8, torch int8) against transformers' model `ref` with
    the same rounding: its linear layers hold weight_class (q, k, v merged; Phi-3's stored merged), the
    embedding, output layer and mixture-of-experts experts stay float, and the fused CPU decode step stands
    aside; prompt logprobs match ref's within tolerance, and greedy tokens match ref's."""
    from tokenmill import SamplingParams

    model = llm.engine.model
    attn = model.layers[1].self_attn
    assert isinstance(attn.qkv_proj.qweight, weight_class) and isinstance(attn.o_proj.qweight, weight_class)
    assert attn.qkv_proj.qweight.shape == (sum(attn.qkv_proj.out_sizes), attn.qkv_proj.in_features)
    assert model.embed_tokens.qweight is None and (model.lm_head is None or model.lm_head.qweight is None)
    if arch == "mixtral":
        assert not model.layers[0].mlp.experts.qparts
    else:
        assert isinstance(model.layers[0].mlp.down_proj.qweight, weight_class)
    prompts = [llm.get_tokenizer().encode(PROMPTS[2]), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 2]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, min_tokens=8, temperature=0, prompt_logprobs=1))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref(torch.tensor([ids], device=device)).logits[0].log_softmax(-1).cpu()
        got = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
        assert got == pytest.approx([want[i - 1, t].item() for i, t in enumerate(ids) if i], abs=tolerance)
        with torch.no_grad():
            ref_tokens = ref.generate(torch.tensor([ids], device=device), max_new_tokens=8, min_new_tokens=8,
                                      do_sample=False)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref_tokens
    assert model.built_fused_decoder() is None
