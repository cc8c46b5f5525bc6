#!/usr/bin/env bash
# Set up from a bare machine and run the test suite (extra arguments go to pytest).
. "$(dirname "$0")/_venv.sh" '.[test]'
# The dashboard test drives a real headless browser: Debian's chromium and its driver, where apt can
# install them (the test skips, saying why, where they are missing).
if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }) \
        || echo "note: could not install chromium; the dashboard's browser test will skip" >&2
fi
python -m pytest "$@"
