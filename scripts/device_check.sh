#!/usr/bin/env bash
# On a lent GPU machine (torch with CUDA, nothing else installed): run from the repo root.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=. timeout 300 python scripts/device_check.py --device "${1:-cuda}"
