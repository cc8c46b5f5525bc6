"""A 1.17B-parameter Llama-shaped model (untied embeddings) with random weights and the default model's
tokenizer, as a Hugging Face folder and as GGUF files made by llama.cpp's own tools: for speed measurements
at a size where weight bandwidth dominates (speed does not depend on the weights' values; run requests
with ignore_eos).

    python benchmarks/make_1b_model.py OUT_DIR [--llama-cpp-dir DIR] [--hf-only]

Writes OUT_DIR/hf (bfloat16 safetensors, seed 0) and OUT_DIR/model-{BF16,Q8_0,Q4_0,Q4_K_M,Q5_K_M,IQ4_XS,Q3_K_M,Q2_K}.gguf, with
DIR/convert_hf_to_gguf.py and DIR/bin/llama-quantize (DIR defaults to ~/.cache/tokenmill/llama.cpp; build
it with benchmarks/build_llama_cpp.sh). Steps whose output already exists are skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

QUANTS = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "IQ4_XS", "Q3_K_M", "Q2_K")


def default_llama_cpp_dir() -> Path:
    if os.environ.get("TOKENMILL_CACHE"):
        cache = Path(os.environ["TOKENMILL_CACHE"])
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill"
    return cache / "llama.cpp"


def make_hf(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tokenmill import LLM

    tokenizer = LLM(dtype="float32", device="cpu", kv_cache_memory=1 << 24).get_tokenizer()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
                      initializer_range=0.02, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)  # built in bf16: one 2 GiB copy
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)


def run(cmd: list[str], out: Path, env: dict[str, str] | None = None, produced: str | None = None) -> None:
    """Runs cmd, which writes out's temporary name (`produced`, else out + ".tmp"), then renames it to out."""
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    Path(produced or f"{out}.tmp").rename(out)


def convert_bf16(lc: Path, hf: Path, bf16: Path) -> None:
    """llama.cpp's own converter (from the tools in lc): the Hugging Face folder hf as the BF16 GGUF file bf16."""
    pythonpath = os.pathsep.join(filter(None, [str(lc / "gguf-py"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    run([sys.executable, str(lc / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16", "--outfile", f"{bf16}.tmp"],
        bf16, env)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--llama-cpp-dir", type=Path, default=default_llama_cpp_dir())
    ap.add_argument("--hf-only", action="store_true", help="write OUT_DIR/hf alone (no llama.cpp tools needed)")
    args = ap.parse_args()
    out: Path = args.out_dir.expanduser()
    if args.hf_only:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "hf").exists():
            make_hf(out / "hf")
        return
    lc: Path = args.llama_cpp_dir.expanduser()
    hf, bf16 = out / "hf", out / "model-BF16.gguf"
    ggufs = [bf16] + [out / f"model-{q}.gguf" for q in QUANTS]

    convert, gguf_py, quantize = lc / "convert_hf_to_gguf.py", lc / "gguf-py", lc / "bin" / "llama-quantize"
    if not all(p.exists() for p in ggufs):
        missing = [str(p) for p in (convert, gguf_py, quantize) if not p.exists()]
        if missing:
            sys.exit(f"missing llama.cpp tools: {', '.join(missing)}\n"
                     f"build them with: benchmarks/build_llama_cpp.sh {lc}")
    if not bf16.exists() and importlib.util.find_spec("sentencepiece") is None:
        # convert_hf_to_gguf.py imports it for every Llama model, even one without a tokenizer.model
        sys.exit(f"{convert.name} needs sentencepiece: pip install sentencepiece")

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    if not hf.exists():
        make_hf(hf)
    if not bf16.exists():
        convert_bf16(lc, hf, bf16)
    for q, path in zip(QUANTS, ggufs[1:]):
        if not path.exists():
            run([str(quantize), str(bf16), f"{path}.tmp", q], path)

    print(f"done in {time.perf_counter() - t0:.0f} s")
    hf_bytes = sum(f.stat().st_size for f in hf.iterdir() if f.is_file())
    for p, n in [(hf, hf_bytes)] + [(p, p.stat().st_size) for p in ggufs]:
        print(f"{n / 2**30:7.2f} GiB  {p}")


if __name__ == "__main__":
    main()
