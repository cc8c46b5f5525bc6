#!/usr/bin/env bash
# Set up from a bare machine (a virtual environment with the CPU build of torch) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned to the CPU wheel; tokenmill's own range then keeps it.
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
python -m pytest "$@"
