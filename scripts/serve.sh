#!/usr/bin/env bash
# Set up from a bare machine and serve the built-in default model on 127.0.0.1:8000 (arguments go to serve).
. "$(dirname "$0")/_venv.sh" '.'
exec tokenmill serve "$@"
