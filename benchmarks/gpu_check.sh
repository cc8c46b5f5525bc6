#!/usr/bin/env bash
# The whole GPU check in one call, on a machine with a CUDA GPU and no package index (the image's torch,
# triton and transformers): correctness against transformers and float64 first, then the benchmarks.
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]
#
# 1. tests/test_gpu.py with each attention backend, tests/test_triton_attention.py,
#    tests/test_fp8_weights.py and tests/test_int8_torch.py on the GPU (the test that needs the default
#    model's file is left out);
# 2. benchmarks/gpu_attention.py: decode and prompt attention, Triton against torch's operators;
# 3. batch-1 decode of a 1B Llama-shaped model (random bfloat16 weights) with bfloat16, fp8 and int8 weights,
#    each attention backend, `tokenmill bench latency`.
# Each part's output goes to OUT_DIR (default: gpu-check/), a failing part does not stop the others.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
"$py" -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    >> "$out/gpu.txt" 2>&1

"$py" -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_fp8_weights.py \
    tests/test_int8_torch.py -k "not quantized_file" > "$out/kernels.txt" 2>&1; echo "kernels rc=$?" | tee -a "$out/summary.txt"
"$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$out/gpu-torch.txt" 2>&1
echo "test_gpu torch rc=$?" | tee -a "$out/summary.txt"
TOKENMILL_ATTENTION_BACKEND=triton "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$out/gpu-triton.txt" 2>&1
echo "test_gpu triton rc=$?" | tee -a "$out/summary.txt"

"$py" benchmarks/gpu_attention.py > "$out/attention.txt" 2>&1; echo "attention rc=$?" | tee -a "$out/summary.txt"

model=$out/llama-1b
"$py" - "$model" <<'EOF' > "$out/model.txt" 2>&1
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
sys.path.insert(0, ".")
from tests.conftest import make_tokenizer
cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1])
make_tokenizer(sys.argv[1])
EOF
for backend in torch triton; do
    for q in auto fp8 int8; do
        TOKENMILL_ATTENTION_BACKEND=$backend "$py" -m tokenmill.cli bench latency "$model" --device cuda \
            --dtype bfloat16 --quantization "$q" --batch-size 1 --input-len 128 --output-len 256 --iters 5 \
            > "$out/decode-$backend-$q.txt" 2>&1
        echo "decode $backend $q rc=$? $(tail -n 3 "$out/decode-$backend-$q.txt" | tr '\n' ' ')" | tee -a "$out/summary.txt"
    done
done
