"""1P1D through `pdserve up` (real processes, real NIXL) against a monolithic server:
token-identical greedy output, the KV really moved, nothing leaked."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.utils import free_port, metric, start_server, wait_for_metric

MODEL = "SmolLM2-135M-Instruct"
LONG = "The history of the city is long and full of surprises. " * 90  # > 1000 tokens
COMPLETIONS = [
    "Hi",  # shorter than one block
    [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 2060, 28, 4215, 30, 378, 3458, 282],  # 16
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colours and explain why the sky looks blue during the day. " * 6,
    LONG,
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a large animal."}],
    [{"role": "user", "content": "Write a haiku about the sea. " * 12}],
    [{"role": "user", "content": "Summarise: " + LONG[:2000]}],
]


def _up(dtype: str):
    port, base, side = free_port(), free_port(count=2), free_port(count=2)
    return start_server(["up", "--dtype", dtype, "--kv-cache-memory", "0.25",
                         "--port", str(port), "--base-port", str(base),
                         "--side-channel-base-port", str(side)],
                        url=f"http://127.0.0.1:{port}", timeout=240,
                        ready=lambda s: _up_ready(s, base)), base


def _up_ready(server, base: int) -> bool:
    return all(httpx.get(f"http://127.0.0.1:{p}/health", timeout=1).status_code == 200
               for p in (base, base + 1))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def setup(request):
    dtype = request.param
    mono = start_server(["serve", "--dtype", dtype, "--kv-cache-memory", "0.25",
                         "--port", str(free_port())])
    up, base = _up(dtype)
    yield dtype, mono, up, f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
    up.stop()
    mono.stop()


def _complete(url: str, prompt, stream: bool = False, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "logprobs": 0, "stream": stream, **kw}
    return _post(url + "/v1/completions", body, stream)


def _chat(url: str, messages, stream: bool = False, **kw) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0,
            "logprobs": True, "stream": stream, **kw}
    return _post(url + "/v1/chat/completions", body, stream)


def _post(url: str, body: dict, stream: bool) -> dict:
    """Text, per-token strings and finish reason, from a plain or streamed answer."""
    if not stream:
        r = httpx.post(url, json=body, timeout=300)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        text = c.get("text", c.get("message", {}).get("content"))
        return {"text": text, "tokens": _tokens(c["logprobs"]), "finish": c["finish_reason"]}
    out = {"text": "", "tokens": [], "finish": None}
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                out["text"] += c.get("text", c.get("delta", {}).get("content") or "")
                out["tokens"] += _tokens(c.get("logprobs"))
                out["finish"] = c["finish_reason"] or out["finish"]
    return out


def _tokens(logprobs) -> list[str]:
    if not logprobs:
        return []
    if "content" in logprobs:
        return [t["token"] for t in logprobs["content"]]
    return logprobs["tokens"]


def _cases():
    return [("completion", p) for p in COMPLETIONS] + [("chat", m) for m in CHATS]


def _run(url: str, kind: str, prompt, stream: bool = False) -> dict:
    return (_complete if kind == "completion" else _chat)(url, prompt, stream)


def test_one_at_a_time_identical_to_monolithic(setup):
    """One request at a time, so the decode is idle at every prefill and lends its core,
    and the prefill idle at every decode step and lends its own: both run on two threads
    (core loan) and still match the monolith."""
    dtype, mono, up, prefill, decode = setup
    bytes_before = metric(decode, "pdserve_kv_transfer_bytes_total")
    computed_before = metric(decode, "pdserve_prompt_tokens_computed_total")
    loan_steps = metric(prefill, "pdserve_core_loan_steps_total")
    decode_loan_steps = metric(decode, "pdserve_core_loan_steps_total")
    for kind, prompt in _cases():
        want = _run(mono.url, kind, prompt)
        for stream in (False, True):
            got = _run(up.url, kind, prompt, stream)
            assert got["tokens"] == want["tokens"], (dtype, kind, stream, prompt)
            assert got["text"] == want["text"] and got["finish"] == want["finish"]
    # The decode ran none of the prompts: every prompt token's KV came over NIXL.
    assert metric(decode, "pdserve_prompt_tokens_computed_total") == computed_before
    assert metric(decode, "pdserve_kv_transfer_bytes_total") > bytes_before
    assert metric(prefill, "pdserve_core_loan_steps_total") > loan_steps
    assert metric(decode, "pdserve_core_loan_steps_total") > decode_loan_steps
    _assert_pools_whole(prefill, decode)


def _block_bytes(dtype: str) -> int:
    return 30 * 2 * 16 * 3 * 64 * (4 if dtype == "float32" else 2)


def _pulled_and_saved(decode: str) -> tuple[float, float]:
    return (metric(decode, "pdserve_kv_transfer_bytes_total"),
            metric(decode, "pdserve_kv_transfer_bytes_saved_total"))


def test_transfer_bytes_match_blocks(setup):
    dtype, mono, up, prefill, decode = setup
    info = httpx.get(prefill + "/v1/kv_transfer/info").json()["ranks"][0]
    assert info["engine_id"] and info["side_channel_port"] > 0
    pulled, saved = _pulled_and_saved(decode)
    n = 0
    for prompt in (COMPLETIONS[1], "x" * 200):
        r = httpx.post(up.url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=60)
        n += -(-r.json()["usage"]["prompt_tokens"] // 16)
    # Every prompt block was either pulled or already in the decode's prefix cache.
    now_pulled, now_saved = _pulled_and_saved(decode)
    assert (now_pulled - pulled) + (now_saved - saved) == n * _block_bytes(dtype)


def test_decode_with_a_warm_prefix_pulls_only_what_it_lacks(setup):
    dtype, mono, up, prefill, decode = setup
    shared = "A report on the harbour, its ships and the people who work there. " * 8
    prompts = [shared + "First, the ships.", shared + "Then, the people."]
    pulled, saved = _pulled_and_saved(decode)
    for i, prompt in enumerate(prompts + prompts[:1]):
        want = _complete(mono.url, prompt)
        r = httpx.post(up.url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}, timeout=60)
        assert r.json()["choices"][0]["text"] == want["text"], (dtype, prompt)
        blocks = -(-r.json()["usage"]["prompt_tokens"] // 16)
        now_pulled, now_saved = _pulled_and_saved(decode)
        assert (now_pulled - pulled) + (now_saved - saved) == blocks * _block_bytes(dtype)
        # The first is pulled whole; the others find the 7 full blocks of the shared 120
        # tokens (of 125) in the decode's cache and pull only the 8th.
        assert now_saved - saved == (7 * _block_bytes(dtype) if i else 0), i
        pulled, saved = now_pulled, now_saved
    _assert_pools_whole(prefill, decode)


@pytest.mark.parametrize("setup", ["float32"], indirect=True)
def test_concurrent_identical_to_monolithic(setup):
    dtype, mono, up, prefill, decode = setup
    cases = [(k, p, i % 2 == 1) for i, (k, p) in enumerate(_cases())]
    want = [_run(mono.url, k, p) for k, p, _ in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda c: _run(up.url, *c), cases))
    for w, g in zip(want, got, strict=True):
        assert g["tokens"] == w["tokens"]
    _assert_pools_whole(prefill, decode)


def test_edge_cases_answer_and_free(setup):
    dtype, mono, up, prefill, decode = setup
    # max_tokens=1: the prefill's token is the whole answer.
    one = _complete(up.url, "The capital of France is", max_tokens=1)
    assert one == _complete(mono.url, "The capital of France is", max_tokens=1)
    # The first token completes a stop string: decode answers at once, nothing leaks.
    stop = _complete(up.url, "The capital of France is", stop=[" Par"])
    assert stop["text"] == "" and stop["finish"] == "stop"
    # A seeded sampled request is reproducible through P/D.
    kw = {"temperature": 0.9, "seed": 1234, "logprobs": None}
    assert _complete(up.url, "Tell me a story", **kw)["text"] == \
        _complete(mono.url, "Tell me a story", **kw)["text"]
    _assert_pools_whole(prefill, decode)


def test_bad_kv_transfer_params_are_refused(setup):
    dtype, mono, up, prefill, decode = setup
    base = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [0],
            "remote_host": "127.0.0.1", "remote_port": 5999, "remote_request_id": "r"}
    for bad, word in [({"remote_host": "10.1.2.3"}, "not allowed"),
                      ({"remote_block_ids": [0, 1, 2]}, "blocks"),
                      ({"remote_block_ids": [-1]}, "non-negative"),
                      ({"remote_port": "x"}, "remote_port"),
                      ({"first_token_id": 5, "first_token_top_logprobs": [[5]]},
                       "first_token_top_logprobs")]:
        r = httpx.post(decode + "/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 2,
            "kv_transfer_params": {**base, **bad}}, timeout=30)
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    # vLLM's proxy sends nulls to the prefill: "not given", never a 400.
    r = httpx.post(prefill + "/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "remote_engine_id": None, "remote_block_ids": None,
            "remote_host": None, "remote_port": None}}, timeout=30)
    assert r.status_code == 200 and r.json()["kv_transfer_params"]["do_remote_prefill"]
    # A decode takes the handover, so the prefill lets go (no lease left for later tests).
    r = httpx.post(decode + "/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2,
        "kv_transfer_params": r.json()["kv_transfer_params"]}, timeout=30)
    assert r.status_code == 200, r.text
    _assert_pools_whole(prefill, decode)


def test_lease_expires_when_no_decode_comes(tmp_path):
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"kv_lease_duration": 1.5}}
    server = start_server(["serve", "--dtype", "float32", "--kv-cache-memory", "0.1",
                           "--port", str(free_port()), "--kv-transfer-config", json.dumps(kv),
                           "--kv-side-channel-port", str(free_port())])
    try:
        r = httpx.post(server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "A prompt whose decode never comes " * 4,
            "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)
        held = len(r.json()["kv_transfer_params"]["remote_block_ids"])
        assert metric(server.url, "pdserve_kv_blocks_held_for_remote") == held > 0
        wait_for_metric(server.url, "pdserve_kv_lease_expired_total", 1, timeout=10)
        _assert_pools_whole(server.url)
    finally:
        server.stop()


def _assert_pools_whole(*urls: str) -> None:
    for url in urls:
        total = metric(url, "pdserve_kv_blocks_total")
        wait_for_metric(url, "pdserve_kv_blocks_free", total, timeout=10)
        assert metric(url, "pdserve_kv_blocks_held_for_remote") == 0


def _sampling_view(url: str, path: str, body: dict, stream: bool) -> dict:
    """Each choice's text, finish reason and logprobs, and the usage, from a plain or a
    streamed answer (streamed logprobs concatenated per choice)."""
    if not stream:
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        answer = r.json()
        return {"usage": answer["usage"], "choices": {c["index"]: (
            c.get("text", c.get("message", {}).get("content")), c["finish_reason"],
            c["logprobs"]) for c in answer["choices"]}}
    view: dict = {"usage": None, "choices": {}}
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for chunk in map(json.loads, events[:-1]):
        view["usage"] = chunk.get("usage") or view["usage"]
        for c in chunk["choices"]:
            text, _, lps = view["choices"].get(c["index"], ("", None, None))
            piece = c.get("text", (c.get("delta") or {}).get("content") or "")
            lp = c["logprobs"]
            if lps is not None:  # concatenate the chunks' logprob lists
                lp = {k: (lps[k] + v if isinstance(v, list) else v) for k, v in lp.items()}
            view["choices"][c["index"]] = (text + piece, c["finish_reason"], lp)
    return view


SAMPLING = {"temperature": 0.9, "seed": 5, "n": 3, "max_tokens": 8, "ignore_eos": True,
            "repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": 0.4,
            "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("setup", ["float32"], indirect=True)
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_sampling_api_identical_to_monolithic(setup, kind):
    """n > 1 (seeded), penalties (the decode counts the prefill's token) and top logprobs
    (the first token's come from the prefill) through the proxy: what one server answers."""
    dtype, mono, up, prefill, decode = setup
    if kind == "completion":
        path, body = "/v1/completions", {**SAMPLING, "prompt": "one two three one two",
                                         "logprobs": 3}
    else:
        path, body = "/v1/chat/completions", {**SAMPLING, "messages": CHATS[0],
                                              "logprobs": True, "top_logprobs": 3}
    for stream in (False, True):
        want = _sampling_view(mono.url, path, body, stream)
        got = _sampling_view(up.url, path, body, stream)
        assert len(want["choices"]) == 3 and want["usage"]["completion_tokens"] == 24
        _assert_close(got, want, f"{kind}, stream={stream}")
    _assert_pools_whole(prefill, decode)


def _assert_close(got, want, where: str) -> None:
    """Equal, except floats (logprobs) within 1e-4: n choices batched together on one
    server and apart on another round differently."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4), where
    elif isinstance(want, dict | list | tuple):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        if isinstance(want, dict):
            assert got.keys() == want.keys(), (where, got, want)
        pairs = ((got[k], want[k]) for k in want) if isinstance(want, dict) \
            else zip(got, want, strict=True)
        for i, (g, w) in enumerate(pairs):
            _assert_close(g, w, f"{where}/{i}")
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("setup", ["float32"], indirect=True)
def test_bad_sampling_values_are_400_through_the_proxy(setup):
    dtype, mono, up, prefill, decode = setup
    for bad, word in [({"repetition_penalty": 0}, "repetition_penalty"),
                      ({"n": 2, "logprobs": 21}, "logprobs"),
                      ({"n": 2, "prompt_logprobs": 21}, "prompt_logprobs"),
                      ({"n": 2, "model": "gpt-4o"}, "does not exist")]:
        r = httpx.post(up.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                         **bad}, timeout=60)
        assert r.status_code in (400, 404) and word in r.json()["error"]["message"], r.text
    _assert_pools_whole(prefill, decode)
    r = httpx.post(up.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2},
                   timeout=60)
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]  # still serving


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "population": {"type": "integer", "minimum": 0,
                                                        "maximum": 50000000}},
        "required": ["city", "population"]}
DISTANCE = r"[A-Z][a-z]+ is [0-9]{1,4} km from [A-Z][a-z]+\."
CONSTRAINTS = {
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "city", "schema": CITY}}},
        lambda t: set(json.loads(t)) == set(CITY["properties"])),
    "regex": ({"structured_outputs": {"regex": DISTANCE}},
              lambda t: re.fullmatch(DISTANCE, t)),
}


@pytest.mark.parametrize("setup", ["float32"], indirect=True)
@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_structured_output_identical_to_monolithic(setup, constraint):
    """The prefill samples the first token under the constraint, the decode's matcher starts
    after it: the disaggregated answer is the monolith's, token for token."""
    dtype, mono, up, prefill, decode = setup
    extra, check = CONSTRAINTS[constraint]
    computed = metric(decode, "pdserve_prompt_tokens_computed_total")
    for ask, prompt in ((_complete, "A large city and how far it is:"), (_chat, CHATS[1])):
        want = ask(mono.url, prompt, max_tokens=60, **extra)
        assert want["finish"] == "stop" and check(want["text"]), want
        for stream in (False, True):
            got = ask(up.url, prompt, stream, max_tokens=60, **extra)
            assert got == want, (constraint, stream)
    # Every prompt was prefilled on the prefill and its KV pulled: really disaggregated.
    assert metric(decode, "pdserve_prompt_tokens_computed_total") == computed
    _assert_pools_whole(prefill, decode)


PROMPT_LOGPROBS = [  # (path, body): echo with logprobs, lm-eval's max_tokens 0, vLLM's field
    ("/v1/completions", {"prompt": COMPLETIONS[4], "echo": True, "logprobs": 2,
                         "max_tokens": 6}),
    ("/v1/completions", {"prompt": "The capital of France is", "echo": True, "logprobs": 1,
                         "max_tokens": 0}),
    ("/v1/completions", {"prompt": LONG, "prompt_logprobs": 3, "max_tokens": 4}),  # 3 chunks
    ("/v1/chat/completions", {"messages": CHATS[1], "prompt_logprobs": 2, "max_tokens": 6}),
]


def _answer(url: str, path: str, body: dict) -> dict:
    """What must not depend on where the request ran: choices, usage, prompt logprobs."""
    r = httpx.post(url + path, json={"model": MODEL, "temperature": 0, **body}, timeout=300)
    assert r.status_code == 200, r.text
    a = r.json()
    return {"choices": a["choices"], "usage": a["usage"], "prompt": a.get("prompt_logprobs")}


@pytest.mark.parametrize("setup", ["float32"], indirect=True)
def test_prompt_logprobs_identical_to_monolithic(setup):
    """The prefill scores the prompt and hands its logprobs to the decode in
    kv_transfer_params; the proxy's answer is the monolith's, and the decode computed no
    prompt token."""
    dtype, mono, up, prefill, decode = setup
    computed = metric(decode, "pdserve_prompt_tokens_computed_total")
    for path, body in PROMPT_LOGPROBS:
        want = _answer(mono.url, path, body)
        assert want["choices"][0].get("prompt_logprobs") or want["prompt"] or \
            want["choices"][0]["logprobs"]["token_logprobs"][0] is None
        _assert_close(_answer(up.url, path, body), want, path)
    echo = PROMPT_LOGPROBS[0][1]  # streamed: the first chunk carries the prompt's
    _assert_close(_sampling_view(up.url, "/v1/completions", {"model": MODEL, **echo,
                                                             "temperature": 0}, True),
                  _sampling_view(mono.url, "/v1/completions", {"model": MODEL, **echo,
                                                               "temperature": 0}, True),
                  "streamed echo")
    assert metric(decode, "pdserve_prompt_tokens_computed_total") == computed
    # Streamed, vLLM's field is refused by the decode only (the prefill is sent no stream):
    # the decode tells the prefill to free the prompt's blocks (a lease would hold them 30 s).
    r = httpx.post(up.url + "/v1/completions", json={
        "model": MODEL, "prompt": LONG, "prompt_logprobs": 1, "stream": True}, timeout=60)
    assert r.status_code == 400 and "stream=True" in r.json()["error"]["message"], r.text
    _assert_pools_whole(prefill, decode)


@pytest.mark.parametrize("setup", ["float32"], indirect=True)
def test_tokenize_through_the_proxy(setup):
    dtype, mono, up, prefill, decode = setup
    for path, body in [("/tokenize", {"prompt": LONG[:200], "return_token_strs": True}),
                       ("/tokenize", {"messages": CHATS[1]}),
                       ("/detokenize", {"tokens": [504, 3458, 282]})]:
        got, want = (httpx.post(u + path, json=body, timeout=30) for u in (up.url, mono.url))
        assert got.status_code == 200 and got.json() == want.json(), got.text
    r = httpx.post(up.url + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert r.status_code == 400 and "tokens must be in" in r.json()["error"]["message"]
