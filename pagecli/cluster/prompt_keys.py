"""Route keys computed on the driver from the model's tokenizer (no weights are loaded there).

The driver tokenizes each prompt only to route it: workers receive the prompt's text (or messages)
and encode it themselves with their Engine, so a key that differs from the engine's own token ids
(a chat template quirk, say) can cost prefix hits but never changes an output. A prompt the driver
cannot tokenize gets no key; its worker then reports the line's error as the single-process run would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagecli.cluster.routing import route_key
from pagecli.errors import request_failure
from pagecli.models.chat_template import apply_chat_template


class PromptKeys:
    def __init__(self, model_folder: Path, block_size: int) -> None:
        from pagecli.models.loader import load_tokenizer

        self.tokenizer = load_tokenizer(model_folder)
        self.block_size = block_size
        self._template = getattr(self.tokenizer, "chat_template", None)

    def key(self, prompt: str | list[dict[str, Any]]) -> bytes | None:
        try:
            return route_key(self._token_ids(prompt), self.block_size)
        except Exception as exc:  # noqa: BLE001 - a line's own fault only loses it its key
            if request_failure(exc) is None and not isinstance(exc, (TypeError, ValueError)):
                raise
            return None

    def _token_ids(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if self._template:
            text = apply_chat_template(self.tokenizer, prompt)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        text = "\n".join(f"{m['role']}: {m['content']}" for m in prompt) + "\nassistant:"
        return list(self.tokenizer(text)["input_ids"])
