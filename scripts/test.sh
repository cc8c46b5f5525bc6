#!/usr/bin/env bash
# Set up from a bare machine and run the test suite (extra arguments go to pytest).
. "$(dirname "$0")/_venv.sh" '.[test]'
python -m pytest "$@"
