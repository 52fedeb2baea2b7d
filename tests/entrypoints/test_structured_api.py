"""Structured output and tools through a real `pdserve serve`: every constrained answer
(plain, n > 1, streamed) validates against its schema, matches its regex or is one of the
choices; bad constraints are 400s with the library's message and the server keeps
serving; tool calls round-trip through the openai client."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.test_api_server import _post, _stream, _texts

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3}},
    "required": ["name", "age", "languages"]}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
CHOICES = ["positive", "negative", 'neutral "meh"']
ASK = [{"role": "user", "content": "Describe a person who speaks French."}]
SAMPLED = {"temperature": 1.0, "seed": 3, "max_tokens": 100}


def _json_checker(schema):
    return lambda text: jsonschema.validate(json.loads(text), schema) or True


# Bounded constraints: every answer completes its grammar well within max_tokens.
CASES = {
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}}, _json_checker(PERSON)),
    "so_json_string": ({"structured_outputs": {"json": json.dumps(PERSON)}},
                       _json_checker(PERSON)),
    "regex": ({"structured_outputs": {"regex": DATE}}, lambda t: re.fullmatch(DATE, t)),
    "choice": ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    "grammar": ({"structured_outputs": {"grammar": 'root ::= "x=" [0-9]{1,6} ";"'}},
                lambda t: re.fullmatch(r"x=[0-9]{1,6};", t)),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("case", CASES)
def test_every_choice_follows_its_constraint(server, case, path, stream):
    extra, check = CASES[case]
    body = {**SAMPLED, "n": 3, **extra,
            **({"prompt": "A person, as JSON:"} if path == "completions" else
               {"messages": ASK})}
    if stream:
        chunks = _stream(server, path, body)
        texts = _texts(chunks, "text" if path == "completions" else "")
        finish = {c["index"]: c["finish_reason"] for k in chunks for c in k["choices"]
                  if c["finish_reason"]}
    else:
        key = "text" if path == "completions" else "message"
        choices = _post(server, path, body)["choices"]
        texts = {c["index"]: c[key] if key == "text" else c[key]["content"] for c in choices}
        finish = {c["index"]: c["finish_reason"] for c in choices}
    assert sorted(texts) == [0, 1, 2] and set(finish.values()) == {"stop"}, finish
    for text in texts.values():
        assert check(text), (case, text)


def test_json_object_is_an_object(client):
    resp = client.chat.completions.create(
        model="smol", temperature=0, max_tokens=60, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Answer with the JSON object {"ok": true}.'}])
    c = resp.choices[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)


def test_greedy_json_ends_with_the_grammar(client):
    resp = client.chat.completions.create(
        model="smol", messages=ASK, temperature=0, max_tokens=120,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}})
    c = resp.choices[0]
    assert c.finish_reason == "stop"  # the grammar was complete, not cut at max_tokens
    jsonschema.validate(json.loads(c.message.content), PERSON)


@pytest.mark.parametrize(("extra", "words"), [
    ({"structured_outputs": {"regex": "a(b"}}, "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "missing"),
    ({"structured_outputs": {"choice": []}}, "at least 1"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"whitespace": "x"}}, "exactly one|Extra inputs"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "objekt"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "not both"),
])
def test_bad_constraints_are_400s_and_the_server_keeps_serving(server, extra, words):
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"prompt": "Hi", "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and re.search(words, err["message"]), err
    ok = _post(server, "completions", {"prompt": "Hi", "max_tokens": 4,
                                       "structured_outputs": {"choice": ["a", "b"]}})
    assert ok["choices"][0]["text"] in ("a", "b")


# -- tools ------------------------------------------------------------------------------

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
             "required": ["zone"]}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_enforced_tool_calls_round_trip_through_the_openai_client(client, choice):
    resp = client.chat.completions.create(model="smol", messages=QUESTION, tools=TOOLS,
                                          tool_choice=choice, temperature=0, max_tokens=80)
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _check_calls(c.message.tool_calls)
    if isinstance(choice, dict):
        assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    # The conversation goes on with the call and its result in the history.
    call = c.message.tool_calls[0]
    follow = client.chat.completions.create(
        model="smol", tools=TOOLS, temperature=0, max_tokens=16,
        messages=[*QUESTION, c.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}])
    assert follow.choices[0].message.content


def test_enforced_tool_calls_stream_as_tool_call_deltas(client):
    stream = client.chat.completions.create(model="smol", messages=QUESTION, tools=TOOLS,
                                            tool_choice="required", temperature=1.0, seed=5,
                                            max_tokens=80, n=2, stream=True)
    calls: dict[tuple[int, int], dict] = {}
    finish = {}
    for chunk in stream:
        for c in chunk.choices:
            finish[c.index] = c.finish_reason or finish.get(c.index)
            for d in c.delta.tool_calls or []:
                call = calls.setdefault((c.index, d.index), {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert {i for i, _ in calls} == {0, 1}
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


def test_auto_answers_text_or_valid_calls(client):
    # The tiny model may well answer in words: either way the answer is well formed.
    resp = client.chat.completions.create(model="smol", messages=QUESTION, tools=TOOLS,
                                          temperature=0, max_tokens=60)
    c = resp.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        _check_calls(c.message.tool_calls)
    else:
        assert c.message.content and c.finish_reason in ("stop", "length")


@pytest.mark.parametrize(("extra", "words"), [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
])
def test_bad_tool_requests_are_400s(client, extra, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=4,
                                       **extra)
