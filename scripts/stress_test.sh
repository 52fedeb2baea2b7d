#!/usr/bin/env bash
# The suite with one core kept busy beside it: a test that passes only on an idle machine
# fails here. `make test-stress`; extra arguments go to pytest (e.g. tests/e2e).
# The hog is stress-ng where the OS has it, else a Python busy loop; it runs at normal
# priority, so it takes a whole core from the suite's servers, not only their idle time.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v stress-ng >/dev/null; then
    stress-ng --cpu 1 --quiet &
else
    python3 -c 'while True: pass' &
fi
hog=$!
trap 'kill $hog 2>/dev/null || true' EXIT
.venv/bin/python -m pytest -q "${@:-tests}"
