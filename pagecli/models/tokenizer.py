"""pagecli's own tokenizer for a generic tokenizer.json: ids, text and the chat template exactly as
transformers' fast tokenizer gives them, without importing transformers (about 0.7 s of every start).

`load_plain_tokenizer` returns one only where nothing in the folder would make transformers read it
differently; anything it does not know (a setting in tokenizer_config.json, a special token that
transformers would add or re-flag, a second chat template) sends the folder back to transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pagecli.models.chat_template import DEFAULT_LIMITS, TemplateLimits, render_conversation

_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_EXTRA_TOKEN_LISTS = ("additional_special_tokens", "extra_special_tokens")
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# tokenizer_config.json keys that change nothing pagecli reads: transformers stores them, or only pads and
# truncates with them (pagecli does neither). Any other key (add_bos_token, legacy, add_prefix_space,
# split_special_tokens, a model-specific *_token, ...) takes the transformers path.
_INERT_KEYS = frozenset({
    "tokenizer_class", "backend", "is_local", "local_files_only", "name_or_path", "processor_class",
    "model_max_length", "model_input_names", "padding_side", "truncation_side", "clean_up_tokenization_spaces",
    "chat_template", "added_tokens_decoder", *_NAMED_TOKENS, *_EXTRA_TOKEN_LISTS,
})
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")
# transformers rewrites the pre-tokenizer regex of large-vocabulary Mistral tokenizers (or warns that it should).
_MISTRAL_REGEX_TYPES = frozenset({"mistral", "mistral3", "voxtral", "ministral", "pixtral"})
_MISTRAL_REGEX_MIN_VOCAB = 100_000
_NO_LENGTH_LIMIT = int(1e30)  # transformers' model_max_length when the config names none


class PlainTokenizer:
    """tokenizer.json through the `tokenizers` library and the chat template through a sandboxed jinja2,
    behind the part of transformers' tokenizer interface that pagecli calls."""

    renders_under_limits = True  # apply_chat_template takes `limits` (chat_template.apply_chat_template)

    def __init__(self, backend: Tokenizer, special_tokens: dict[str, str], chat_template: str | None,
                 model_max_length: int) -> None:
        self.backend = backend  # a tokenizers.Tokenizer without padding or truncation
        self.special_tokens = special_tokens  # bos_token, eos_token, ... -> their text; the template sees them
        self.chat_template = chat_template
        self.model_max_length = model_max_length

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._token_id("unk_token")

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("PlainTokenizer never cleans up tokenization spaces; pass False.")
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False, tools: list[dict[str, Any]] | None = None,
                            limits: TemplateLimits = DEFAULT_LIMITS) -> str:
        """The conversation as text; raises jinja2.TemplateError where the template rejects it, and
        ValueError without a template or messages, as transformers does; TemplateLimitExceeded past `limits`."""
        if tokenize:
            raise ValueError("PlainTokenizer renders chat templates as text only; pass tokenize=False.")
        if not self.chat_template:
            raise ValueError("Cannot apply a chat template: this tokenizer has none.")
        if not messages:
            raise ValueError("Cannot apply a chat template to an empty conversation.")
        return render_conversation(self.chat_template, messages, self.special_tokens, tools=tools,
                                   add_generation_prompt=add_generation_prompt, limits=limits)


def token_ids_of(tokenizer: Any, tokens: Iterable[str]) -> dict[str, int]:
    """The ids of those of `tokens` that are one token of the vocabulary, added tokens included. A PlainTokenizer
    asks tokenizers for each (microseconds); another (transformers') is read through its whole get_vocab(), a dict
    of the vocabulary built at each call (0.1 s for 49,152 tokens)."""
    tokens = list(tokens)
    if not tokens:
        return {}
    if isinstance(tokenizer, PlainTokenizer):
        found = {token: tokenizer.backend.token_to_id(token) for token in tokens}
        return {token: index for token, index in found.items() if index is not None}
    vocab = tokenizer.get_vocab()
    return {token: vocab[token] for token in tokens if token in vocab}


def load_plain_tokenizer(folder: Path) -> PlainTokenizer | None:
    """The folder's tokenizer, or None where transformers could read it differently from plain tokenizers."""
    config = _read_json(folder / "tokenizer_config.json")
    old_map = _read_json(folder / "special_tokens_map.json") if (folder / "special_tokens_map.json").exists() else {}
    if not _config_is_inert(config, folder) or not isinstance(old_map, dict):
        return None
    special_tokens = _named_special_tokens(config, old_map)
    extra_tokens = _extra_special_tokens(config, old_map)
    if special_tokens is None or extra_tokens is None:
        return None
    try:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - tokenizers raises plain Exception; transformers words the error
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None  # transformers switches them off for each call
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None  # transformers cleans up decoded text, except for BPE vocabularies
    if not _added_tokens_stay(config, backend, [*special_tokens.values(), *extra_tokens]):
        return None
    if backend.get_vocab_size() > _MISTRAL_REGEX_MIN_VOCAB and _model_type(folder) in _MISTRAL_REGEX_TYPES:
        return None
    max_length = config.get("model_max_length")
    return PlainTokenizer(backend, special_tokens, _chat_template(folder, config),
                          _NO_LENGTH_LIMIT if max_length is None else max_length)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _config_is_inert(config: Any, folder: Path) -> bool:
    """Whether tokenizer_config.json and the files beside it hold nothing transformers would act on."""
    if not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES:
        return False
    if not set(config) <= _INERT_KEYS or not (folder / "tokenizer.json").is_file():
        return False
    if any(config.get(key, "right") not in ("left", "right") for key in ("padding_side", "truncation_side")):
        return False  # transformers refuses it; let it say so
    template = config.get("chat_template")
    if (template is not None and not isinstance(template, str)) or (folder / "additional_chat_templates").exists():
        return False  # several named templates
    if not isinstance(config.get("added_tokens_decoder", {}), dict):
        return False
    return not (folder / "added_tokens.json").exists()


def _named_special_tokens(config: dict[str, Any], old_map: dict[str, Any]) -> dict[str, str] | None:
    """bos_token, eos_token, ... -> text, in transformers' order. None for a token written as an object
    in the config, or where special_tokens_map.json (which transformers may read over the config) differs."""
    tokens = {name: config[name] for name in _NAMED_TOKENS if config.get(name) is not None}
    if not all(isinstance(text, str) for text in tokens.values()):
        return None
    if any(old_map.get(name) is not None and _token_text(old_map[name]) != tokens.get(name) for name in _NAMED_TOKENS):
        return None
    return tokens


def _extra_special_tokens(config: dict[str, Any], old_map: dict[str, Any]) -> list[str] | None:
    """The additional special tokens of the config and special_tokens_map.json; None if not plain lists."""
    extras = []
    for source in (config, old_map):
        for key in _EXTRA_TOKEN_LISTS:
            tokens = source.get(key) or []
            if not isinstance(tokens, list):
                return None
            extras.extend(_token_text(token) if source is old_map else token for token in tokens)
    return extras if all(isinstance(text, str) for text in extras) else None


def _token_text(value: Any) -> Any:
    """A token as special_tokens_map.json writes it: its text, or an object with the text as `content`."""
    return value.get("content") if isinstance(value, dict) else value


def _added_tokens_stay(config: dict[str, Any], backend: Tokenizer, special_texts: list[str]) -> bool:
    """Whether transformers would leave tokenizer.json's added tokens as they are: every special token
    named in the config is already an added special token, and the config's added_tokens_decoder
    repeats tokenizer.json's (transformers re-adds its entries, so any flag that differs would change)."""
    added = backend.get_added_tokens_decoder()  # id -> tokenizers.AddedToken
    special = {token.content for token in added.values() if token.special}
    if not all(text in special for text in special_texts):
        return False
    for token_id, entry in config.get("added_tokens_decoder", {}).items():
        if not isinstance(entry, dict) or not set(entry) <= {"content", *_ADDED_TOKEN_FLAGS}:
            return False
        wanted = {"single_word": False, "lstrip": False, "rstrip": False, "special": False, **entry}
        wanted.setdefault("normalized", not wanted["special"])  # tokenizers' own default
        current = added.get(int(token_id)) if str(token_id).isdigit() else None
        if current is None or any(getattr(current, key) != wanted.get(key) for key in ("content", *_ADDED_TOKEN_FLAGS)):
            return False
    return True


def _model_type(folder: Path) -> str | None:
    config = _read_json(folder / "config.json")
    return config.get("model_type") if isinstance(config, dict) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja where the folder has one (transformers prefers it), else the config's."""
    try:
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    except FileNotFoundError:
        return config.get("chat_template")


