# Sourced by the scripts here: a virtual environment in .venv with the CPU build of torch, then tokenmill.
# $1: what to install besides torch, e.g. "." or ".[test]".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned to the CPU wheel; tokenmill's own range (torch>=2.5) then keeps it.
python -m pip install -q torch==2.13.0
python -m pip install -q -e "$1"
