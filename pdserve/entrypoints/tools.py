"""Chat tools: what the prompt says about them, the grammar that enforces a `required` or
named `tool_choice`, and tool calls parsed out of the model's text.

Formats parsed (`auto`), those of the families pdserve serves:
- Hermes / Qwen2.5 / SmolLM2: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call (SmolLM2 puts a list of calls in one block);
- Llama 3.x: the whole answer is `{"name": ..., "parameters": {...}}` (several joined by
  `;`), after `<|python_tag|>` where the template asks for it.
Enforced choices have fixed shapes: a named function's output is its arguments object,
`required`'s a JSON array of `{"name": ..., "parameters": {...}}` (as vLLM's)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured import GrammarSpec

TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
MARKERS = ("<tool_call>", "<|python_tag|>")
# For templates that do not render `tools` (SmolLM2's): the Hermes format, which SmolLM2
# and Qwen were trained on, in a system message.
FALLBACK_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\nFor each "
    "function call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>')


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> GrammarSpec | None:
    """The grammar that enforces `choice` ("required" or a named function), else None."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        return GrammarSpec.json_schema(parameters(tool))
    if choice != "required":
        return None
    calls = [{"type": "object", "required": ["name", "parameters"], "properties": {
        "name": {"enum": [t["function"]["name"]]}, "parameters": parameters(t)}}
        for t in tools]
    return GrammarSpec.json_schema({"type": "array", "minItems": 1, "items": {"anyOf": calls}})


def prompt_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    """`messages` with the tools described in the system message, for a template that does
    not render them itself."""
    text = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"},
                *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def parse(text: str, choice: str | dict[str, Any], names: set[str]
          ) -> tuple[str | None, list[ToolCall]]:
    """(the text around the calls or None, the calls) of an answer; no calls where it holds
    none that parse and name one of `names`."""
    if isinstance(choice, dict):
        args = _json(text)
        return (None, [ToolCall(choice["function"]["name"], json.dumps(args))]) \
            if isinstance(args, dict) else (text, [])
    if choice == "required":
        calls = _calls(_json(text), names)
    else:
        calls = _tagged(text, names) or _calls(_llama(text), names)
    if not calls:
        return text, []
    content = text.split("<tool_call>")[0].strip() if "<tool_call>" in text else ""
    return content or None, calls


def streamable(text: str) -> int:
    """How much of an `auto` answer's text so far may stream as content: up to where a tool
    call may begin (a marker, a prefix of one at the end, or a leading `{`)."""
    if text.lstrip().startswith("{") or not text.strip():
        return 0
    cut = min((i for m in MARKERS if (i := text.find(m)) >= 0), default=len(text))
    for m in MARKERS:  # the end may be the start of a marker still arriving
        for k in range(len(m) - 1, 0, -1):
            if text.endswith(m[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


def _tagged(text: str, names: set[str]) -> list[ToolCall]:
    return [c for block in TAG.findall(text) for c in _calls(_json(block), names)]


def _llama(text: str) -> list[Any]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    whole = _json(body)
    return [whole] if whole is not None else [_json(part) for part in body.split(";")]


def _calls(obj: Any, names: set[str]) -> list[ToolCall]:
    """The calls in a parsed object or list of them; all or none."""
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            args = _json(args)
        if not isinstance(args, dict):
            return []
        calls.append(ToolCall(item["name"], json.dumps(args)))
    return calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
