"""`pdserve bench serve` end to end against a real `pdserve serve`."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serve import main
from tests.utils import free_port, metric, start_server


@pytest.fixture(scope="module")
def server():
    port = free_port()
    s = start_server(["serve", "--dtype", "float32", "--kv-cache-memory", "0.25",
                      "--port", str(port)])
    yield s
    s.stop()


def _run(server, tmp_path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    rc = main(["--base-url", server.url, "--num-prompts", "4", "--random-input-len", "32",
               "--random-output-len", "8", "--request-rate", "inf", "--ignore-eos",
               "--no-progress", "--save-result", "--result-file", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_completions(server, tmp_path, capsys):
    r = _run(server, tmp_path, "--endpoint", "/v1/completions", "--goodput", "ttft:60000",
             "e2el:60000")
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert (r["completed"], r["failed"], r["num_prompts"]) == (4, 0, 4)
    assert r["total_output_tokens"] == 4 * 8 and r["output_lens"] == [8] * 4
    assert r["total_input_tokens"] == 4 * 32  # token-id prompts: usage agrees exactly
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs
    assert r["request_rate"] == "inf" and r["model_id"] and r["errors"] == [""] * 4
    assert r["request_throughput"] == pytest.approx(4 / r["duration"])
    assert r["output_throughput"] == pytest.approx(32 / r["duration"])
    assert r["total_token_throughput"] == pytest.approx((128 + 32) / r["duration"])
    assert 0 < r["mean_ttft_ms"] <= r["mean_e2el_ms"] <= r["duration"] * 1000
    assert r["mean_tpot_ms"] > 0 and r["mean_itl_ms"] > 0
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{key}_ms" in r
    assert all(len(itl) >= 1 for itl in r["itls"])


def test_chat(server, tmp_path):
    r = _run(server, tmp_path, "--endpoint", "/v1/chat/completions")
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (4, 0, 32)
    # Random words are a token each; the chat template adds its own (SmolLM2's default system
    # prompt is about 30 tokens).
    assert all(32 <= n <= 32 + 48 for n in r["input_lens"])


def test_warmups_reach_the_server_but_neither_the_figures_nor_its_cache(server, tmp_path):
    tokens, hits = (metric(server.url, n) for n in ("pdserve_generation_tokens_total",
                                                    "pdserve_prefix_cache_hits_total"))
    r = _run(server, tmp_path, "--num-warmups", "3", "--seed", "7")
    assert (r["completed"], r["total_output_tokens"]) == (4, 32)
    # test prompt, warm-ups and the run all reached the engine
    assert metric(server.url, "pdserve_generation_tokens_total") - tokens == (1 + 3 + 4) * 8
    # and none of the run's prompts was one the warm-ups had left in the prefix cache
    assert metric(server.url, "pdserve_prefix_cache_hits_total") == hits


def test_unreachable_server_fails_cleanly(tmp_path):
    assert main(["--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m",
                 "--num-prompts", "1", "--no-progress"]) == 1
