"""`pdserve bench serve` metrics against hand-computed timelines, and its client's parsing."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from pdserve.bench.serve import (
    TOKEN_IDS,
    RequestRecord,
    arrival_offsets,
    compute_metrics,
    format_table,
    parse_goodput,
    sample_random,
    send,
)


def rec(start: float, chunks: list[float], out: int | None, prompt: int = 10,
        error: str = "") -> RequestRecord:
    return RequestRecord(start, prompt, chunks, chunks[-1] if chunks else start, out,
                         success=not error, error=error)


# A: TTFT 100 ms, ITLs 100/100/200, E2EL 500, TPOT 400/3. B: TTFT 300, ITL 200, E2EL 500,
# TPOT 200. C failed mid-stream: it must not touch any latency or token figure.
A = rec(0.0, [0.1, 0.2, 0.3, 0.5], 4, prompt=10)
B = rec(1.0, [1.3, 1.5], 2, prompt=20)
C = rec(2.0, [2.9], 1, prompt=1000, error="HTTP 500: boom")


@pytest.fixture
def m() -> dict:
    return compute_metrics([A, B, C], duration=2.0)


def test_counts_and_throughputs(m):
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    assert m["request_goodput"] is None  # no SLOs given


def test_ttft(m):
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(100)  # population std, as numpy/vLLM
    assert m["p90_ttft_ms"] == pytest.approx(280)  # linear interpolation of 100 and 300
    assert m["p99_ttft_ms"] == pytest.approx(298)


def test_tpot_excludes_first_token(m):
    assert m["mean_tpot_ms"] == pytest.approx((400 / 3 + 200) / 2)
    assert m["median_tpot_ms"] == pytest.approx((400 / 3 + 200) / 2)
    assert m["p99_tpot_ms"] == pytest.approx(400 / 3 + 0.99 * (200 - 400 / 3))


def test_itl_pools_every_gap(m):
    assert m["mean_itl_ms"] == pytest.approx(150)  # 100, 100, 200, 200
    assert m["median_itl_ms"] == pytest.approx(150)
    assert m["p99_itl_ms"] == pytest.approx(200)
    assert m["std_itl_ms"] == pytest.approx(50)


def test_e2el_is_start_to_last_chunk(m):
    assert m["mean_e2el_ms"] == m["median_e2el_ms"] == m["p99_e2el_ms"] == pytest.approx(500)
    assert m["std_e2el_ms"] == pytest.approx(0)


@pytest.mark.parametrize(("slo", "good"), [
    ({"ttft": 250}, 1),  # B's 300 ms misses
    ({"tpot": 150}, 1),  # B's 200 ms misses
    ({"e2el": 500}, 2),  # an SLO met exactly counts
    ({"ttft": 250, "e2el": 400}, 0),  # all SLOs must hold
    ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 2),
])
def test_goodput(slo, good):
    m = compute_metrics([A, B, C], 2.0, slo)
    assert m["request_goodput"] == pytest.approx(good / 2.0)


def test_single_token_answer_has_no_tpot_but_passes_a_tpot_slo():
    one = rec(0.0, [0.05], 1)
    m = compute_metrics([one], 1.0, {"tpot": 0})
    assert m["mean_tpot_ms"] == 0 and m["mean_itl_ms"] == 0  # empty sets report 0
    assert m["mean_ttft_ms"] == pytest.approx(50) and m["request_goodput"] == 1.0


def test_output_tokens_fall_back_to_chunk_count():
    m = compute_metrics([rec(0.0, [0.1, 0.2, 0.4], None)], 1.0)
    assert m["total_output_tokens"] == 3
    assert m["mean_tpot_ms"] == pytest.approx(150)


def test_all_failed():
    m = compute_metrics([C], 1.0, {"ttft": 1})
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (0, 1, 0)
    assert m["request_goodput"] == 0 and m["mean_ttft_ms"] == 0


def test_custom_percentiles():
    m = compute_metrics([A, B], 2.0, percentiles=[50, 99.9])
    assert m["p50_ttft_ms"] == pytest.approx(200) and "p99.9_e2el_ms" in m
    assert "p99_ttft_ms" not in m


def test_table(m):
    table = format_table({**m, "request_rate": math.inf, "max_concurrency": None}, [90, 99])
    assert table.splitlines()[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    for line in ("Successful requests:", "Failed requests:", "Mean TTFT (ms):",
                 "P99 ITL (ms):", "Median E2EL (ms):", "Time per Output Token"):
        assert line in table
    assert "goodput" not in table


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500, "tpot": 50.5}
    assert parse_goodput(None) is None
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_random_dataset_lengths_and_ids():
    rng = np.random.default_rng(0)
    s = sample_random(200, 100, 10, 0.5, chat=False, rng=rng)
    assert all(50 <= r.prompt_len <= 150 and len(r.prompt) == r.prompt_len for r in s)
    assert all(5 <= r.output_len <= 15 for r in s)
    assert all(TOKEN_IDS[0] <= t < TOKEN_IDS[1] for r in s for t in r.prompt)
    assert len({r.prompt_len for r in s}) > 10  # lengths vary
    chat = sample_random(3, 32, 8, 0.0, chat=True, rng=rng)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 32 for r in chat)


def test_arrivals():
    assert arrival_offsets(3, math.inf, np.random.default_rng(0)) == [0, 0, 0]
    t = arrival_offsets(4000, 10.0, np.random.default_rng(0))
    assert t[0] == 0 and t == sorted(t)
    assert np.diff(t).mean() == pytest.approx(0.1, rel=0.05)  # Poisson at 10 req/s


def _stream(events: list[dict | str]) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n"
                   for e in events).encode()


def _send(body: bytes, status: int = 200) -> RequestRecord:
    transport = httpx.MockTransport(lambda _: httpx.Response(status, content=body))

    async def go():
        async with httpx.AsyncClient(transport=transport) as c:
            return await send(c, "http://x/v1/completions", {}, 7)
    return asyncio.run(go())


def test_send_parses_chunks_and_usage():
    r = _send(_stream([{"choices": [{"text": "a"}]}, {"choices": [{"delta": {"content": "b"}}]},
                       {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
                       "[DONE]"]))
    assert r.success and not r.error and r.text == "ab"
    assert len(r.chunk_times) == 2 and (r.prompt_len, r.output_tokens) == (9, 2)
    assert r.start <= r.chunk_times[0] <= r.chunk_times[1] <= r.end


@pytest.mark.parametrize(("body", "status", "error"), [
    (b'{"error": "no"}', 400, "HTTP 400"),
    (_stream(["[DONE]"]), 200, "no choices"),
    (_stream([{"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}}, "[DONE]"]),
     200, "engine died"),
    (b"data: {not json\n\n", 200, "JSONDecodeError"),
])
def test_send_failures(body, status, error):
    r = _send(body, status)
    assert not r.success and error in r.error
