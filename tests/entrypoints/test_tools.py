"""Tool calls parsed from canned model outputs in the formats of the families pdserve
serves, the grammars that enforce `required` and named choices, and what an `auto` stream
may send as content before a call could begin."""

from __future__ import annotations

import json

import pytest

from pdserve.entrypoints import tools

NAMES = {"get_weather", "get_time"}
WEATHER = {"city": "Paris", "unit": "celsius"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time"}}]


def _calls(text: str, choice="auto") -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = tools.parse(text, choice, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("text", "want"), [
    # Hermes / Qwen2.5: one block per call
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
     '\n</tool_call>', [("get_weather", WEATHER)]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     [("get_weather", WEATHER), ("get_time", {})]),
    # SmolLM2: a list of calls in one block
    ('<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}]</tool_call>',
     [("get_time", {"zone": "UTC"})]),
    # Llama 3.x JSON, with "parameters", bare or after <|python_tag|>, several joined by ;
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     [("get_weather", WEATHER)]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}', [("get_time", {})]),
    ('{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
     '{"city": "Paris", "unit": "celsius"}}', [("get_time", {}), ("get_weather", WEATHER)]),
    # arguments as a JSON string (some models emit OpenAI's own shape)
    ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',
     [("get_time", {"zone": "UTC"})]),
])
def test_auto_parses_each_family_format(text, want):
    assert _calls(text) == (None, want)


def test_text_before_a_tagged_call_is_content():
    content, calls = _calls('Let me check.\n<tool_call>{"name": "get_time", "arguments": {}}'
                            '</tool_call>')
    assert content == "Let me check." and calls == [("get_time", {})]


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    '{"name": "unknown_tool", "parameters": {}}',  # not one of the tools
    '<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>',  # cut off
    '{"city": "Paris"}',  # JSON, but not a call
    '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "nope"}]</tool_call>',
])
def test_what_is_not_a_call_stays_text(text):
    assert _calls(text) == (text, [])


def test_enforced_shapes_parse():
    assert _calls('{"city": "Paris", "unit": "celsius"}',
                  {"type": "function", "function": {"name": "get_weather"}}) \
        == (None, [("get_weather", WEATHER)])
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]'
    assert _calls(text, "required") == (None, [("get_weather", WEATHER)])


def test_enforcing_grammars():
    named = tools.grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.value) == TOOLS[0]["function"]["parameters"]
    required = json.loads(tools.grammar(TOOLS, "required").value)
    assert required["minItems"] == 1
    assert [c["properties"]["name"] for c in required["items"]["anyOf"]] == \
        [{"enum": ["get_weather"]}, {"enum": ["get_time"]}]
    assert tools.grammar(TOOLS, "auto") is None


@pytest.mark.parametrize(("text", "n"), [
    ("Sure, here it is", 16),
    ("Let me check <tool_call>{", 13),  # up to the marker
    ("Let me check <tool", 13),  # a marker may be arriving
    ("  {\"name\"", 0),  # a Llama-style call from the start
    ("\n", 0),  # nothing to tell yet
])
def test_auto_streams_content_up_to_a_possible_call(text, n):
    assert tools.streamable(text) == n


def test_tools_are_described_where_the_template_does_not():
    msgs = tools.prompt_messages([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "hi"}], TOOLS)
    assert msgs[0]["content"].startswith("Be brief.") and "get_weather" in msgs[0]["content"]
    assert msgs[1:] == [{"role": "user", "content": "hi"}]
    assert tools.prompt_messages([{"role": "user", "content": "hi"}], TOOLS)[0]["role"] \
        == "system"
