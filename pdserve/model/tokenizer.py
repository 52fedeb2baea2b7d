"""The model's tokenizer and chat template, read from its HF folder without transformers
(importing transformers costs seconds at every start)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pdserve.model.loader import ModelLoadError


@dataclass(slots=True)
class Tokenizer:
    backend: HFTokenizer
    eos_token_ids: frozenset[int]
    chat_template: jinja2.Template | None
    special: dict[str, str]  # bos_token / eos_token strings for the template
    max_token_chars: int = 0  # the most characters one token can stand for
    template_source: str = ""

    @classmethod
    def from_folder(cls, folder: Path, eos_ids: list[int]) -> Tokenizer:
        file = folder / "tokenizer.json"
        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as e:  # `tokenizers` raises a bare Exception; the user needs one line
            raise ModelLoadError(f"cannot read tokenizer {file}: {e}") from None
        cfg_file = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token")}
        eos = set(eos_ids)
        if special["eos_token"] and (tid := backend.token_to_id(special["eos_token"])) is not None:
            eos.add(tid)
        template_file = folder / "chat_template.jinja"
        source = template_file.read_text() if template_file.exists() else cfg.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        template = env.from_string(source) if isinstance(source, str) else None
        # A vocabulary entry's length in its own alphabet (byte-level BPE: a byte a character)
        # bounds the text characters the token decodes to.
        longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1)
        return cls(backend, frozenset(eos), template, special, longest,
                   source if isinstance(source, str) else "")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def token_strs(self, ids: list[int]) -> list[str]:
        """The vocabulary's own strings for ids (byte-level BPE: "Ġword"), as HF's
        convert_ids_to_tokens."""
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self.chat_template.render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (SmolLM2's does not)."""
        return self.chat_template is not None and "tools" in self.template_source


def _token_str(value: object) -> str:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _raise(message: str) -> None:
    raise ValueError(message)
