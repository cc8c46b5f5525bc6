# Sourced by the scripts here: a virtual environment in .venv with torch, then tokenmill.
# $1: what to install besides torch, e.g. "." or ".[test]".
# TOKENMILL_TORCH_INDEX: a package index to take torch from, e.g. https://download.pytorch.org/whl/cpu
# (PyTorch's CPU wheel index). Unset, torch comes from the default index: the CPU wheel where that index
# serves it, the (larger) CUDA build from PyPI on Linux.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned; tokenmill's own range (torch>=2.5) then keeps it.
if [ -n "${TOKENMILL_TORCH_INDEX:-}" ]; then
    python -m pip install -q torch==2.13.0 --index-url "$TOKENMILL_TORCH_INDEX"
else
    python -m pip install -q torch==2.13.0
fi
python -m pip install -q -e "$1"
