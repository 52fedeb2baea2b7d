"""Incremental detokenization with stop strings, run in the engine so a stop string can
end a request (and free its blocks) at the step it appears."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.model.tokenizer import Tokenizer


@dataclass(slots=True)
class Detokenizer:
    tokenizer: Tokenizer
    stop: list[str]
    text: str = ""  # all output text so far
    sent: int = 0  # chars of `text` already handed out
    ids: list[int] = field(default_factory=list)
    _prefix: int = 0  # decode from here, so merges and spaces come out right
    _read: int = 0  # tokens whose text is already in `text`

    def add(self, token_id: int) -> bool:
        """Append a token; True if a stop string now ends the text (it is cut off)."""
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
        full = self.tokenizer.decode(self.ids[self._prefix:])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            self.text += full[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._cut_at_stop()

    def take(self, final: bool) -> str:
        """New text since the last call; holds back what may still become a stop string."""
        end = len(self.text) if final or not self.stop else \
            max(self.sent, len(self.text) - max(len(s) for s in self.stop) + 1)
        new, self.sent = self.text[self.sent:end], end
        return new

    def _cut_at_stop(self) -> bool:
        # Only the tail can hold a new match: look back one stop-string length.
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)
