"""Bytes a decode pulls for one long prompt of a sliding-window model, against the bytes it
leaves unread (sliding layers' blocks before their window): a prefill and a decode server of
a random bf16 model in Gemma 3's layout, real NIXL.

    PYTHONPATH=. python scripts/window_transfer_bytes.py TOKENS WINDOW LAYERS
    (README: 4096 512 6)"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from pdserve.model.loader import resolve
from tests.e2e.cluster import kv_config, remote_pd, serve, stop
from tests.utils import FAMILIES, metric, write_family_model


def main(tokens: int, window: int, layers: int) -> None:
    # Gemma 3's pattern: five sliding layers, then a global one.
    FAMILIES["gemma3_text"] = {
        **FAMILIES["gemma3_text"], "sliding_window": window, "num_hidden_layers": layers,
        "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention"
                        for i in range(layers)], "max_position_embeddings": 2 * tokens}
    folder = write_family_model("gemma3_text", Path(tempfile.mkdtemp()), resolve(None))
    servers = [serve(kv_config(), "--model", str(folder), "--no-prefix-caching", "--dtype",
                     "bfloat16", "--max-model-len", str(tokens + 64)) for _ in range(2)]
    try:
        prefill, decode = (s.url for s in servers)
        r = remote_pd(prefill, decode, {"prompt": list(range(100, 100 + tokens)),
                                        "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        pulled = metric(decode, "pdserve_kv_transfer_bytes_total")
        saved = metric(decode, "pdserve_kv_transfer_bytes_saved_total")
        print(json.dumps({"tokens": tokens, "window": window, "layers": layers,
                          "pulled": pulled, "not_pulled": saved,
                          "not_pulled_fraction": round(saved / (pulled + saved), 4)}))
    finally:
        stop(*servers)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
