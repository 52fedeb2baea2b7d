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
import torch

from pdserve.engine.request import Request
from pdserve.model.loader import EMBEDDED_NAME
from tests.entrypoints.conftest import ALIAS, MAX_MODEL_LEN
from tests.utils import free_port, greedy, metric, run_engine

PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name three colours of the rainbow."}]


def _engine_greedy(engine, ids: list[int], max_tokens: int):
    req = Request("ref", ids, greedy(max_tokens, logprobs=True))
    return run_engine(engine, [req])["ref"]


def test_models_lists_the_served_names(client):
    models = client.models.list().data
    assert [m.id for m in models] == [EMBEDDED_NAME, ALIAS]


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_model_by_any_served_name_or_none_else_404(server, path):
    body = {"prompt": "hi"} if path == "completions" else {"messages": CHAT}
    body["max_tokens"] = 1
    for model in (ALIAS, None):
        r = httpx.post(f"{server.url}/v1/{path}", timeout=60,
                       json={**body, **({"model": model} if model else {})})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == EMBEDDED_NAME  # the first name, as vLLM
    r = httpx.post(f"{server.url}/v1/{path}", json={**body, "model": "gpt-4o"}, timeout=60)
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "The model `gpt-4o` does not exist.",
                                 "type": "NotFoundError", "param": "model", "code": 404}


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
    "empty prompt": ("completions", {"prompt": ""}, "empty"),
    "empty token list": ("completions", {"prompt": []}, "empty"),
    "text without tokens": ("completions", {"prompt": "\x06"}, "no tokens"),
    "no messages": ("chat/completions", {"messages": []}, "messages"),
    "max_tokens 0": ("completions", {"prompt": "hi", "max_tokens": 0},
                     "max_tokens must be at least 1 (0 only with echo"),
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
    "presence_penalty 3": ("completions", {"prompt": "hi", "presence_penalty": 3},
                           "presence_penalty"),
    "frequency_penalty -2.5": ("chat/completions", {"messages": CHAT,
                                                    "frequency_penalty": -2.5},
                               "frequency_penalty"),
    "repetition_penalty 0": ("completions", {"prompt": "hi", "repetition_penalty": 0},
                             "repetition_penalty"),
    "repetition_penalty NaN": ("completions", b'{"prompt": "hi", "repetition_penalty": NaN}',
                               "repetition_penalty"),
    "logprobs 21": ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    "top_logprobs 21": ("chat/completions", {"messages": CHAT, "logprobs": True,
                                             "top_logprobs": 21}, "top_logprobs"),
    "top_logprobs without logprobs": ("chat/completions", {"messages": CHAT,
                                                           "top_logprobs": 2},
                                      "`logprobs` must be set to true"),
    "echo with logprobs 21": ("completions", {"prompt": "hi", "echo": True, "logprobs": 21},
                              "logprobs"),
    "prompt_logprobs 21": ("completions", {"prompt": "hi", "prompt_logprobs": 21},
                           "prompt_logprobs"),
    "prompt_logprobs -1 (chat)": ("chat/completions", {"messages": CHAT, "prompt_logprobs": -1},
                                  "prompt_logprobs"),
    "prompt_logprobs streamed": ("completions", {"prompt": "hi", "prompt_logprobs": 1,
                                                 "stream": True},
                                 "`prompt_logprobs` are not available when `stream=True`"),
    "not JSON": ("completions", b'{"prompt": "hi",', "the request body is not valid JSON"),
    "a prompt longer than any context": ("completions", {"prompt": "word " * 300_000},
                                         "a prompt of 1500000 characters is longer"),
    "n 0": ("completions", {"prompt": "hi", "n": 0}, "n"),
    "n 129": ("chat/completions", {"messages": CHAT, "n": 129}, "n"),
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
    # Still serving, the KV pool whole.
    ok = httpx.post(f"{server.url}/v1/completions", timeout=60,
                    json={"prompt": "hi", "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200, ok.text
    _wait_idle(server.url)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_a_413_before_it_is_read(server, chunked):
    """9 MiB (the limit is 8 MiB), with a length or chunked (then counted as it comes)."""
    body = json.dumps({"prompt": "x" * (9 * 2**20)}).encode()
    content = (body[i:i + 2**20] for i in range(0, len(body), 2**20)) if chunked else body
    r = httpx.post(f"{server.url}/v1/completions", content=content, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert "--max-request-bytes" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_openai_client_sees_bad_request_error(client):
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=EMBEDDED_NAME, prompt=LONG, max_tokens=16)


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_mid_stream_frees_blocks(server, n):
    body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True, "n": n}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3 * n):
            chunk = json.loads(next(events)[6:])
            assert chunk["choices"][0]["finish_reason"] is None  # still generating
        assert metric(server.url, "pdserve_num_requests_running") == n  # every choice
    # Leaving the block closed the connection; the server must abort the request.
    _wait_idle(server.url)


def _wait_idle(url: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not (metric(url, "pdserve_num_requests_running") == 0 and metric(
            url, "pdserve_kv_blocks_free") == metric(url, "pdserve_kv_blocks_total")):
        assert time.monotonic() < deadline, httpx.get(url + "/metrics").text
        time.sleep(0.1)


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


# -- the sampling API ------------------------------------------------------------------------

def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/v1/{path}", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _texts(chunks: list[dict], key: str) -> dict[int, str]:
    """Each choice's text, joined from its stream chunks."""
    out: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            piece = c["text"] if key == "text" else c["delta"].get("content") or ""
            out[c["index"]] = out.get(c["index"], "") + piece
    return out


SEEDED = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 7,
          "ignore_eos": True}


def test_n_choices_are_seeded_streams_reproducible_and_distinct(server, engine_f32):
    got = _post(server, "completions", {**SEEDED, "n": 3})
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in got["choices"]]
    assert len(set(texts)) == 3, texts  # each choice its own stream
    assert [c["text"] for c in _post(server, "completions", {**SEEDED, "n": 3})["choices"]] \
        == texts
    # Choice i is the request with seed + i (vLLM's rule), alone.
    assert [_post(server, "completions", {**SEEDED, "seed": 7 + i})["choices"][0]["text"]
            for i in range(3)] == texts
    prompt_len = len(engine_f32.tokenizer.encode(SEEDED["prompt"]))
    assert got["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 24,
                            "total_tokens": prompt_len + 24}


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_n_choices_stream_with_one_usage_chunk(server, path):
    body = {**SEEDED, "n": 2, "stream_options": {"include_usage": True}}
    if path != "completions":
        body = {**body, "messages": CHAT}
        del body["prompt"]
    full = _post(server, path, body)
    chunks = _stream(server, path, body)
    key = "text" if path == "completions" else "message"
    want = {c["index"]: c[key] if key == "text" else c[key]["content"]
            for c in full["choices"]}
    assert _texts(chunks, key) == want
    usage = [c for c in chunks if c.get("usage")]
    assert usage == [chunks[-1]] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == full["usage"]
    if path != "completions":  # each choice's first delta names the role
        firsts = {}
        for chunk in chunks:
            for c in chunk["choices"]:
                firsts.setdefault(c["index"], c["delta"])
        assert all(d.get("role") == "assistant" for d in firsts.values()) and len(firsts) == 2


def _engine_top(engine, ids: list[int], max_tokens: int, k: int, **kw) -> Request:
    req = Request("top", ids, greedy(max_tokens, logprobs=True, top_logprobs=k, **kw))
    run_engine(engine, [req])
    return req


def test_completion_top_logprobs_equal_engine(server, engine_f32):
    tok = engine_f32.tokenizer
    want = _engine_top(engine_f32, tok.encode(PROMPT), 6, 3)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    lp = _post(server, "completions", body)["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(want.output_logprobs, abs=1e-4)
    for pos, (token, top) in enumerate(zip(lp["tokens"], lp["top_logprobs"], strict=True)):
        # The chosen token and the 3 likeliest (here, greedy: the chosen is among them).
        expect = {tok.decode([t]): v for t, v in want.output_top_logprobs[pos]}
        assert top.keys() == expect.keys() and token in top
        assert list(top.values()) == pytest.approx(list(expect.values()), abs=1e-4)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(6)]
    # Streamed: the same, chunk by chunk.
    chunks = _stream(server, "completions", body)
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["top_logprobs"]]
    assert streamed == lp["top_logprobs"]


def test_chat_top_logprobs_equal_engine(server, engine_f32):
    tok = engine_f32.tokenizer
    want = _engine_top(engine_f32, tok.encode(tok.apply_chat_template(CHAT)), 6, 4)
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 4}
    content = _post(server, "chat/completions", body)["choices"][0]["logprobs"]["content"]
    for entry, lp, top in zip(content, want.output_logprobs, want.output_top_logprobs,
                              strict=True):
        assert entry["logprob"] == pytest.approx(lp, abs=1e-4)
        assert entry["bytes"] == list(entry["token"].encode())
        assert [e["token"] for e in entry["top_logprobs"]] == [tok.decode([t]) for t, _ in top]
        assert [e["logprob"] for e in entry["top_logprobs"]] == \
            pytest.approx([v for _, v in top], abs=1e-4)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy
    chunks = _stream(server, "chat/completions", body)
    assert [e for c in chunks if c["choices"] for e in c["choices"][0]["logprobs"]["content"]] \
        == content


def test_penalties_equal_engine(server, engine_f32):
    prompt = "one two three one two three one two"
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    req = Request("pen", engine_f32.tokenizer.encode(prompt),
                  greedy(10, ignore_eos=True, **penalties))
    want = run_engine(engine_f32, [req])["pen"]
    plain = _post(server, "completions", {"prompt": prompt, "max_tokens": 10,
                                          "temperature": 0, "ignore_eos": True})
    got = _post(server, "completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                        "ignore_eos": True, **penalties})
    assert got["choices"][0]["text"] == want.text != plain["choices"][0]["text"]


def test_echo_prepends_the_prompt(server, engine_f32):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    plain = _post(server, "completions", body)["choices"][0]["text"]
    assert _post(server, "completions", {**body, "echo": True})["choices"][0]["text"] == \
        PROMPT + plain
    chunks = _stream(server, "completions", {**body, "echo": True})
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert _texts(chunks, "text") == {0: PROMPT + plain}
    ids = engine_f32.tokenizer.encode(PROMPT)  # token ids echo as their text
    echoed = _post(server, "completions", {**body, "prompt": ids, "echo": True})
    assert echoed["choices"][0]["text"] == engine_f32.tokenizer.decode(ids) + plain


# -- prompt logprobs ---------------------------------------------------------------------------

def _engine_prompt_logprobs(engine, ids: list[int], k: int):
    req = Request("prompt-lp", ids, greedy(1, prompt_logprobs=k))
    run_engine(engine, [req])
    return req.prompt_logprobs


def test_echo_with_logprobs_in_openai_shape(client, engine_f32):
    tok = engine_f32.tokenizer
    ids = tok.encode(PROMPT)
    want = _engine_prompt_logprobs(engine_f32, ids, 2)
    kw = {"model": EMBEDDED_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
          "logprobs": 2}
    plain = client.completions.create(**kw).choices[0]
    resp = client.completions.create(**kw, echo=True)
    assert isinstance(resp, openai.types.Completion)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert isinstance(lp, openai.types.completion_choice.Logprobs)
    assert choice.text == PROMPT + plain.text
    n = len(ids)
    assert lp.tokens == [tok.decode([t]) for t in ids] + plain.logprobs.tokens
    # OpenAI's and vLLM's shape: the first prompt token has no logprob.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([e.logprob for e in want], abs=1e-4)
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    for pos, e in enumerate(want, 1):  # the prompt token and the 2 likeliest
        assert lp.top_logprobs[pos].keys() == {lp.tokens[pos]} | {tok.decode([t])
                                                                  for t, _ in e.top}
    for got, alone in zip(lp.top_logprobs[n:], plain.logprobs.top_logprobs, strict=True):
        # (a GEMM over more rows may round the last digits differently)
        assert got.keys() == alone.keys()
        assert list(got.values()) == pytest.approx(list(alone.values()), abs=1e-4)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == choice.text
    # vLLM's field rides along, one entry per prompt token.
    assert len(choice.model_extra["prompt_logprobs"]) == n


def test_lm_eval_scoring_matches_hf(server, hf_model, tokenizer):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1 (or 0: the prompt
    alone). The prompt's logprobs are HF's log_softmax within 1e-4 (float32)."""
    text = "The lighthouse keeper climbed the spiral stairs every evening at dusk."
    ids = tokenizer.encode(text)
    with torch.inference_mode():
        hf = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    want = hf[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    body = {"prompt": text, "echo": True, "logprobs": 1, "temperature": 0}
    one = _post(server, "completions", {**body, "max_tokens": 1})["choices"][0]["logprobs"]
    assert one["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
    assert len(one["tokens"]) == len(ids) + 1
    zero = _post(server, "completions", {**body, "max_tokens": 0})
    choice = zero["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == one["token_logprobs"][:len(ids)]
    assert zero["usage"]["completion_tokens"] == 0
    assert _stream(server, "completions", {**body, "max_tokens": 0})[0]["choices"][0][
        "logprobs"] == choice["logprobs"]


def test_echo_with_logprobs_streamed(server):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 3, "max_tokens": 5, "temperature": 0}
    whole = _post(server, "completions", body)["choices"][0]["logprobs"]
    chunks = _stream(server, "completions", body)
    joined = {k: [x for c in chunks for x in c["choices"][0]["logprobs"][k]] for k in whole}
    assert joined == whole
    first = chunks[0]["choices"][0]["logprobs"]  # the prompt's tokens come first
    assert first["token_logprobs"][0] is None and len(first["tokens"]) > 5


def test_vllm_prompt_logprobs_field(server, engine_f32):
    tok = engine_f32.tokenizer
    ids = tok.encode(PROMPT)
    want = _engine_prompt_logprobs(engine_f32, ids, 3)
    got = _post(server, "completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                        "prompt_logprobs": 3})
    choice = got["choices"][0]
    assert choice["logprobs"] is None  # the output's were not asked for
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for token, e, entry in zip(ids[1:], want, entries[1:], strict=True):
        assert next(iter(entry)) == str(token)  # the prompt's token first, then the top 3
        assert entry[str(token)]["logprob"] == pytest.approx(e.logprob, abs=1e-4)
        assert entry[str(token)]["rank"] == e.rank
        assert entry[str(token)]["decoded_token"] == tok.decode([token])
        assert [entry[str(t)]["rank"] for t, _ in e.top] == [1, 2, 3]
    chat = _post(server, "chat/completions", {"messages": CHAT, "max_tokens": 2,
                                              "prompt_logprobs": 1})
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]  # response level
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"][1]) in (1, 2)
    plain = _post(server, "completions", {"prompt": PROMPT, "max_tokens": 2})
    assert "prompt_logprobs" not in plain["choices"][0]


# -- /tokenize and /detokenize -------------------------------------------------------------------

def test_tokenize_detokenize_round_trip(server, engine_f32):
    tok = engine_f32.tokenizer
    got = _post_root(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    ids = tok.encode(PROMPT)
    assert got == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                   "token_strs": tok.token_strs(ids)}
    assert got["token_strs"][1].startswith("Ġ")  # the vocabulary's strings, not decoded text
    assert _post_root(server, "/detokenize", {"tokens": ids}) == {"prompt": PROMPT}
    # Messages through the chat template, with or without the assistant's turn opened.
    open_turn = _post_root(server, "/tokenize", {"messages": CHAT})
    assert open_turn["tokens"] == tok.encode(tok.apply_chat_template(CHAT))
    closed = _post_root(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert closed["count"] < open_turn["count"] and "token_strs" not in closed


@pytest.mark.parametrize(("path", "body", "status", "names"), [
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens must be in [0, 49152)"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens must be in"),
    ("/tokenize", {}, 400, "send either `prompt` or `messages`"),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, "either"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4o"}, 404, "does not exist"),
])
def test_bad_tokenize_requests(server, path, body, status, names):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status and names in r.json()["error"]["message"], r.text
    assert _post_root(server, "/detokenize", {"tokens": [504]})["prompt"]  # still serving


def _post_root(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()
