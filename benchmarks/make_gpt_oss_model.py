"""A gpt-oss-shaped model with random weights and the default model's tokenizer, as a Hugging Face folder and
as GGUF files made by llama.cpp's own tools: for decode-speed measurements of MXFP4 experts against their
bf16 form, tokenmill against llama.cpp on the same files (speed does not depend on the weights' values; run
requests with ignore_eos).

    python benchmarks/make_gpt_oss_model.py OUT_DIR [--llama-cpp-dir DIR]

The shape: hidden 1024, 12 layers alternating 128-token sliding-window and full attention, 16 query / 4 KV
heads of 64 with attention sinks, 32 experts of 1024 rows, 4 a token, YaRN rope; 1.34B parameters, 0.28B
active per token (embeddings included). Writes OUT_DIR/hf (bfloat16 safetensors, seed 0),
OUT_DIR/model-BF16.gguf (convert_hf_to_gguf.py) and OUT_DIR/model-MXFP4_MOE.gguf (llama-quantize's
MXFP4_MOE: experts MXFP4, the rest Q8_0), with the tools of DIR (default ~/.cache/tokenmill/llama.cpp; build
them with benchmarks/build_llama_cpp.sh). Steps whose output already exists are skipped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from make_1b_model import convert_bf16, default_llama_cpp_dir, run  # noqa: E402


def make_hf(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    from tokenmill import LLM

    tokenizer = LLM(dtype="float32", device="cpu", kv_cache_memory=1 << 24).get_tokenizer()
    cfg = GptOssConfig(vocab_size=49152, hidden_size=1024, intermediate_size=1024, num_hidden_layers=12,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=32,
                       num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                       tie_word_embeddings=False, initializer_range=0.02, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters", flush=True)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--llama-cpp-dir", type=Path, default=default_llama_cpp_dir())
    args = ap.parse_args()
    out: Path = args.out_dir.expanduser()
    lc: Path = args.llama_cpp_dir.expanduser()
    hf, bf16, mxfp4 = out / "hf", out / "model-BF16.gguf", out / "model-MXFP4_MOE.gguf"
    convert, gguf_py, quantize = lc / "convert_hf_to_gguf.py", lc / "gguf-py", lc / "bin" / "llama-quantize"
    missing = [str(p) for p in (convert, gguf_py, quantize) if not p.exists()]
    if missing:
        sys.exit(f"missing llama.cpp tools: {', '.join(missing)}\nbuild them with: benchmarks/build_llama_cpp.sh {lc}")
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    if not hf.exists():
        make_hf(hf)
    if not bf16.exists():
        convert_bf16(lc, hf, bf16)
    if not mxfp4.exists():
        run([str(quantize), str(bf16), f"{mxfp4}.tmp", "MXFP4_MOE"], mxfp4)
    print(f"done in {time.perf_counter() - t0:.0f} s")
    for p in (bf16, mxfp4):
        print(f"{p.stat().st_size / 2**30:7.2f} GiB  {p}")


if __name__ == "__main__":
    main()
