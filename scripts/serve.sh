#!/usr/bin/env bash
# Set up from a bare machine and serve the built-in default model on 127.0.0.1:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e .
exec tokenmill serve "$@"
