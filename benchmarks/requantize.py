"""A real model's weights in several formats, for quality comparisons on the same weights: a GGUF file read by
transformers (weights dequantized to float32) and saved as a Hugging Face folder, then converted to a BF16 GGUF
and quantized to Q8_0, Q4_K_M, IQ4_XS, Q3_K_M and Q2_K by llama.cpp's own tools.

    python benchmarks/requantize.py SRC.gguf OUT_DIR [--llama-cpp-dir DIR] [--imatrix]

Writes OUT_DIR/hf (float32 safetensors, the tokenizer, a config without quantization) and
OUT_DIR/model-{BF16,Q8_0,Q4_K_M,IQ4_XS,Q3_K_M,Q2_K}.gguf. Steps whose output exists are skipped. The weights of a quantized SRC
already lie on its grid, so requantizing them loses less than quantizing trained float weights would.

--imatrix also writes OUT_DIR/imatrix.gguf, llama.cpp's importance matrix (`llama-imatrix`: each weight
column's mean squared activation) over the built-in calibration text (`tokenmill.data.calibration_text`, a
technical English report, never the evaluation text), and OUT_DIR/model-{Q4_K_M,IQ4_XS,Q3_K_M,Q2_K}-imatrix.gguf
quantized with it, as most published 2- to 4-bit GGUF files are made.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_1b_model import default_llama_cpp_dir, run  # noqa: E402

QUANTS = ("Q8_0", "Q4_K_M", "IQ4_XS", "Q3_K_M", "Q2_K")
IMATRIX_QUANTS = ("Q4_K_M", "IQ4_XS", "Q3_K_M", "Q2_K")


def make_hf(src: Path, folder: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors keeps no shared tensors; the config ties them
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--llama-cpp-dir", type=Path, default=default_llama_cpp_dir())
    ap.add_argument("--imatrix", action="store_true",
                    help="also quantize with an importance matrix over the built-in calibration text")
    ap.add_argument("--imatrix-chunks", type=int, default=128, help="512-token chunks of it to compute the matrix on")
    args = ap.parse_args()
    out, lc = args.out_dir.expanduser(), args.llama_cpp_dir.expanduser()
    convert, gguf_py, quantize = lc / "convert_hf_to_gguf.py", lc / "gguf-py", lc / "bin" / "llama-quantize"
    imatrix_tool = lc / "bin" / "llama-imatrix"
    missing = [str(p) for p in (convert, gguf_py, quantize) + ((imatrix_tool,) if args.imatrix else ())
               if not p.exists()]
    if missing:
        sys.exit(f"missing llama.cpp tools: {', '.join(missing)}\nbuild them with: benchmarks/build_llama_cpp.sh {lc}")
    out.mkdir(parents=True, exist_ok=True)
    hf, bf16 = out / "hf", out / "model-BF16.gguf"
    if not hf.exists():
        make_hf(args.src.expanduser(), hf)
    if not bf16.exists():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(gguf_py), os.environ.get("PYTHONPATH")]))}
        run([sys.executable, str(convert), str(hf), "--outtype", "bf16", "--outfile", f"{bf16}.tmp"], bf16, env)
    for q in QUANTS:
        path = out / f"model-{q}.gguf"
        if not path.exists():
            run([str(quantize), str(bf16), f"{path}.tmp", q], path)
    made = [bf16] + [out / f"model-{q}.gguf" for q in QUANTS]
    if args.imatrix:
        matrix = out / "imatrix.gguf"
        if not matrix.exists():
            from tokenmill.data import calibration_text

            text = out / "calibration.txt"
            text.write_text(calibration_text())
            run([str(imatrix_tool), "-m", str(bf16), "-f", str(text), "-o", f"{matrix}.tmp.gguf", "-c", "512",
                 "--chunks", str(args.imatrix_chunks), "-t", str(os.cpu_count() or 1)], matrix,
                produced=f"{matrix}.tmp.gguf")
        for q in IMATRIX_QUANTS:
            path = out / f"model-{q}-imatrix.gguf"
            if not path.exists():
                run([str(quantize), "--imatrix", str(matrix), str(bf16), f"{path}.tmp", q], path)
            made.append(path)
    for p in made:
        print(f"{p.stat().st_size / 2**20:8.1f} MiB  {p}")


if __name__ == "__main__":
    main()
