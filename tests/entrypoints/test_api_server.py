"""`pdserve serve` end to end: a real server process driven by the official openai client and
raw HTTP. Greedy output equals the in-process engine's; bad input gets an OpenAI-style 400
and the server keeps serving; a client gone mid-stream leaves no KV blocks held; a model
that cannot load stops the server with one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pdserve.engine.request import Request
from pdserve.model.loader import EMBEDDED_NAME
from tests.utils import free_port, greedy, metric, run_engine, start_server

MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def server():
    srv = start_server(["serve", "--dtype", "float32", "--num-kv-blocks", "256",
                        "--max-model-len", str(MAX_MODEL_LEN)])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _engine_greedy(engine, ids: list[int], max_tokens: int):
    req = Request("ref", ids, greedy(max_tokens, logprobs=True))
    return run_engine(engine, [req])["ref"]


def test_models_lists_the_embedded_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [EMBEDDED_NAME]


def test_completion_greedy_equals_engine(client, engine_f32):
    want = _engine_greedy(engine_f32, engine_f32.tokenizer.encode(PROMPT), 16)
    resp = client.completions.create(model=EMBEDDED_NAME, prompt=PROMPT, max_tokens=16,
                                     temperature=0, logprobs=0)
    choice = resp.choices[0]
    assert choice.text == want.text and choice.finish_reason == want.finish_reason
    assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert "".join(choice.logprobs.tokens) == want.text
    assert resp.usage.prompt_tokens == len(engine_f32.tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == len(want.token_ids)


def test_chat_greedy_equals_engine(client, engine_f32):
    tok = engine_f32.tokenizer
    want = _engine_greedy(engine_f32, tok.encode(tok.apply_chat_template(CHAT)), 16)
    resp = client.chat.completions.create(model=EMBEDDED_NAME, messages=CHAT, max_tokens=16,
                                          temperature=0, logprobs=True)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(want.logprobs,
                                                                         abs=1e-4)
    assert resp.usage.completion_tokens == len(want.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + len(want.token_ids)


@pytest.mark.parametrize("include_usage", [True, False])
def test_streaming_completion(client, include_usage):
    kw = {"model": EMBEDDED_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(
        **kw, stream=True, stream_options={"include_usage": include_usage}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage == ([full.usage] if include_usage else [])


def test_streaming_chat_with_usage(client):
    kw = {"model": EMBEDDED_NAME, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == full.choices[0].message.content
    assert chunks[-1].usage == full.usage and not chunks[-1].choices


LONG = "word " * 505  # ~505 tokens: with max_tokens 16 over the 512-token limit
BAD_REQUESTS = {  # case: (endpoint, body, what the error message must name)
    "malformed JSON": ("completions", b'{"prompt": "hi", "max_tokens": ', "JSON"),
    "prompt of wrong type": ("completions", {"prompt": 123}, "prompt"),
    "max_tokens of wrong type": ("completions", {"prompt": "hi", "max_tokens": "many"},
                                 "max_tokens"),
    "messages of wrong type": ("chat/completions", {"messages": "hello"}, "messages"),
    "unknown model": ("completions", {"model": "gpt-4o", "prompt": "hi"}, "gpt-4o"),
    "unknown model (chat)": ("chat/completions", {"model": "gpt-4o", "messages": CHAT},
                             "gpt-4o"),
    "empty prompt": ("completions", {"prompt": ""}, "empty"),
    "empty token list": ("completions", {"prompt": []}, "empty"),
    "no messages": ("chat/completions", {"messages": []}, "messages"),
    "max_tokens 0": ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens -1": ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    "max_tokens 0 (chat)": ("chat/completions", {"messages": CHAT, "max_tokens": 0},
                            "max_tokens"),
    "over max-model-len": ("completions", {"prompt": LONG, "max_tokens": 16},
                           "maximum context length is 512"),
    "max_tokens over max-model-len": ("completions", {"prompt": "hi", "max_tokens": 600},
                                      "maximum context length is 512"),
    "temperature < 0": ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    "top_p 0": ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    "top_p 1.5": ("chat/completions", {"messages": CHAT, "top_p": 1.5}, "top_p"),
    "token id out of vocab": ("completions", {"prompt": [1, 10**9]}, "token ids"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_is_a_readable_400(server, case):
    path, body, names = BAD_REQUESTS[case]
    url = f"{server.url}/v1/{path}"
    r = (httpx.post(url, content=body, headers={"content-type": "application/json"},
                    timeout=30)
         if isinstance(body, bytes) else httpx.post(url, json=body, timeout=30))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert names in error["message"], error
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert "Traceback" not in error["message"]
    # Still serving.
    ok = httpx.post(f"{server.url}/v1/completions", timeout=60,
                    json={"prompt": "hi", "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200, ok.text


def test_openai_client_sees_bad_request_error(client):
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=EMBEDDED_NAME, prompt=LONG, max_tokens=16)


def test_client_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            chunk = json.loads(next(events)[6:])
            assert chunk["choices"][0]["finish_reason"] is None  # still generating
        assert metric(server.url, "pdserve_num_requests_running") == 1
    # Leaving the block closed the connection; the server must abort the request.
    deadline = time.monotonic() + 10
    while not _idle(server.url):
        assert time.monotonic() < deadline, httpx.get(server.url + "/metrics").text
        time.sleep(0.1)


def _idle(url: str) -> bool:
    return metric(url, "pdserve_num_requests_running") == 0 and \
        metric(url, "pdserve_kv_blocks_free") == metric(url, "pdserve_kv_blocks_total")


def _serve_fails(model: str) -> str:
    """Run `pdserve serve --model MODEL`; it must exit non-zero with one line on stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.entrypoints.cli", "serve", "--model", model,
         "--dtype", "float32", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: error: "), proc.stderr
    return lines[0]


def test_missing_model_path_fails_clearly(tmp_path):
    missing = tmp_path / "no-such-model"
    line = _serve_fails(str(missing))
    assert str(missing) in line and "does not exist" in line


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_corrupt_model_fails_clearly(tmp_path, model_folder, with_tokenizer):
    files = ["config.json"] + (["tokenizer.json", "tokenizer_config.json"]
                               if with_tokenizer else [])
    for name in files:
        (tmp_path / name).write_bytes((model_folder / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage, not safetensors" * 40)
    line = _serve_fails(str(tmp_path))
    assert str(tmp_path) in line
    if with_tokenizer:  # the weights are what it trips on
        assert "model.safetensors" in line
