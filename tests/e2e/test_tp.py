"""Tensor parallelism with real processes: TP=2 greedy output equals TP=1 (and HF), and P/D
between prefill and decode of TP sizes (2,1), (1,2), (2,2) equals the monolithic run of the
decode's TP size, with every reader's notification counted and no block leaked.

One random 8-head / 4-KV-head Llama (the embedded SmolLM2's 9 heads / 3 KV heads cannot be
split in two); three kv_both servers (TP1, TP2, TP2) serve both as monolithic references and
as prefill or decode of each pair."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.e2e.cluster import pools_whole
from tests.utils import NEAR_TIE, free_port, hf_greedy, metric, start_server

PROMPTS = [[1, 504, 3458, 282, 4649], list(range(100, 140))]  # 1 block; 3 blocks (40 tokens)
MAX_TOKENS = 8
KV = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
# tp2b's ranks each stage their shard through a host buffer (how CUDA with kv_buffer_device
# cpu, and XPU, run), which CPU forces with use_host_buffer.
STAGED = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"use_host_buffer": True}})
SERVERS = {"tp1": 1, "tp2": 2, "tp2b": 2}


@pytest.fixture(scope="module")
def servers(tiny_llama):
    started = {}
    try:
        for name, tp in SERVERS.items():
            started[name] = start_server([
                "serve", "--model", str(tiny_llama), "--dtype", "float32",
                "--num-kv-blocks", "64", "--kv-layout", "HND", "--tensor-parallel-size", str(tp),
                "--kv-transfer-config", STAGED if name == "tp2b" else KV,
                "--kv-side-channel-port", str(free_port(count=tp))],
                timeout=300)
        yield {name: s.url for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama, tokenizer):
    """HF greedy continuations of PROMPTS as token strings (as the server reports them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    refs = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return [([tokenizer.decode([t]) for t in r.tokens], r.margins) for r in refs]


def _complete(url: str, prompt: list[int], **kw) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(body: dict) -> list[str]:
    return body["choices"][0]["logprobs"]["tokens"]


def _pd(prefill: str, decode: str, prompt: list[int]) -> tuple[dict, dict]:
    """What the proxy does: prefill with do_remote_decode, then decode with its params."""
    first = _complete(prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return first["kv_transfer_params"], _complete(
        decode, prompt, kv_transfer_params=first["kv_transfer_params"])


def _parting(got: list[str], want: list[str]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)


def test_tp2_greedy_matches_tp1_and_hf(servers, reference):
    for prompt, (ref, margins) in zip(PROMPTS, reference, strict=True):
        tp1, tp2 = (_tokens(_complete(servers[n], prompt)) for n in ("tp1", "tp2"))
        for name, got in (("TP1", tp1), ("TP2", tp2)):
            i = _parting(got, ref)
            assert i is None or margins[i] < NEAR_TIE, (
                f"{name} parts from HF at token {i} (margin {margins[i]:.4f}): {got} vs {ref}")
        i = _parting(tp2, tp1)
        assert i is None or margins[i] < NEAR_TIE, f"TP2 {tp2} != TP1 {tp1} at token {i}"
    pools_whole(*servers.values())


def test_kv_transfer_info_lists_every_tp_rank(servers):
    ranks = httpx.get(servers["tp2"] + "/v1/kv_transfer/info", timeout=10).json()["ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    assert {r["dp_rank"] for r in ranks} == {0} and len({r["engine_id"] for r in ranks}) == 1
    base = ranks[0]["side_channel_port"]
    assert [r["side_channel_port"] for r in ranks] == [base, base + 1]


@pytest.mark.parametrize(("prefill", "decode"), [("tp2", "tp1"), ("tp1", "tp2"),
                                                 ("tp2", "tp2b"), ("tp2b", "tp2"),
                                                 ("tp2b", "tp1")])
def test_pd_across_tp_sizes_matches_monolithic(servers, prefill, decode):
    p, d = servers[prefill], servers[decode]
    p_tp, d_tp = SERVERS[prefill], SERVERS[decode]
    readers = max(p_tp, d_tp)  # heads split evenly: each pair of overlapping ranks is a READ
    for prompt in PROMPTS:
        want = _complete(d, prompt)  # the decode's own TP size, monolithic
        computed = metric(d, "pdserve_prompt_tokens_computed_total")
        notified = metric(p, "pdserve_kv_reader_notifications")
        params, got = _pd(p, d, prompt)
        assert params["tp_size"] == p_tp
        assert _tokens(got) == _tokens(want) and \
            got["choices"][0]["text"] == want["choices"][0]["text"], (prompt, got, want)
        assert metric(d, "pdserve_prompt_tokens_computed_total") == computed, \
            "the decode recomputed the prompt instead of reading its KV"
        pools_whole(p, d)  # the prefill freed the blocks: every reader has notified ...
        assert metric(p, "pdserve_kv_reader_notifications") - notified == readers  # ... once


@pytest.fixture(scope="module")
def nhd_decode(tiny_llama):
    server = start_server([
        "serve", "--model", str(tiny_llama), "--dtype", "float32", "--num-kv-blocks", "64",
        "--kv-layout", "NHD", "--kv-transfer-config", KV,
        "--kv-side-channel-port", str(free_port())], timeout=300)
    yield server.url
    server.stop()


def test_an_hnd_tp2_prefill_feeds_an_nhd_tp1_decode(servers, nhd_decode):
    p = servers["tp2"]
    for prompt in PROMPTS:
        want = _complete(nhd_decode, prompt)  # the decode's own answer
        computed = metric(nhd_decode, "pdserve_prompt_tokens_computed_total")
        _, got = _pd(p, nhd_decode, prompt)
        assert _tokens(got) == _tokens(want), prompt
        assert metric(nhd_decode, "pdserve_prompt_tokens_computed_total") == computed
    assert metric(nhd_decode, "pdserve_kv_converted_pulls") >= len(PROMPTS)
    pools_whole(p, nhd_decode)


def test_unequal_tp_from_an_nhd_prefill_is_refused_at_handshake(servers, nhd_decode):
    d = servers["tp2"]
    r = httpx.post(d + "/v1/completions", timeout=120, json={
        "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "kv_transfer_params":
        _complete(nhd_decode, PROMPTS[0], max_tokens=1,
                  kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]})
    message = r.json()["error"]["message"]
    assert r.status_code >= 400 and "prefill TP=1 and decode TP=2 differ" in message, r.text
    assert "start the prefill with --kv-layout HND" in message, message
    pools_whole(nhd_decode, d)  # the refused decode gave the prefill its blocks back
    assert _tokens(_complete(d, PROMPTS[0]))  # still serving


@pytest.fixture(scope="module")
def up_dp2_tp2(tiny_llama):
    """`pdserve up`: a DP2 x TP2 prefill (four ranks), a TP1 decode, the proxy. Strict tiers
    (no overflow to the decode): every prompt of a burst must go through the handover."""
    port, base, side = free_port(), free_port(count=2), free_port(count=5)
    server = start_server(
        ["up", "--model", str(tiny_llama), "--dtype", "float32", "--num-kv-blocks", "64",
         "--kv-layout", "HND", "--prefill-dp", "2", "--prefill-tp", "2", "--decode-tp", "1",
         "--max-prefill-queue", "off",
         "--port", str(port), "--base-port", str(base), "--side-channel-base-port", str(side)],
        url=f"http://127.0.0.1:{port}", timeout=300, ready=lambda s: all(
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=1).status_code == 200
            for p in (base, base + 1)))
    yield server.url, f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}", side
    server.stop()


def test_dp2_tp2_prefill_through_up_matches_monolithic(servers, up_dp2_tp2):
    proxy, prefill, decode, side = up_dp2_tp2
    ranks = httpx.get(prefill + "/v1/kv_transfer/info", timeout=10).json()["ranks"]
    assert [(r["dp_rank"], r["tp_rank"], r["side_channel_port"]) for r in ranks] == \
        [(0, 0, side), (0, 1, side + 1), (1, 0, side + 2), (1, 1, side + 3)]
    prompts = PROMPTS * 2  # at once: the least-loaded choice spreads them over both DP ranks
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _complete(proxy, p), prompts))
    for prompt, body in zip(prompts, got, strict=True):
        assert _tokens(body) == _tokens(_complete(servers["tp1"], prompt)), prompt
    assert metric(decode, "pdserve_prompt_tokens_computed_total") == 0
    pools_whole(prefill, decode)
    per_rank = re.findall(r'^pdserve_kv_reader_notifications{engine_id="([^"]+)"} (\S+)$',
                          httpx.get(prefill + "/metrics", timeout=10).text, re.M)
    # Two readers (the decode's one rank reads both prefill TP ranks) per request, on
    # whichever DP rank took it.
    assert len(per_rank) == 2 and sum(float(v) for _, v in per_rank) == 2 * len(prompts), \
        per_rank


def test_smollm2_tp2_is_refused_with_the_reason():
    r = subprocess.run([sys.executable, "-m", "pdserve.entrypoints.cli", "serve",
                        "--tensor-parallel-size", "2", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "9 attention heads and 3 KV heads do not divide by 2" in r.stderr, r.stderr[-2000:]
