"""pagecli's own tokenizer for a generic tokenizer.json: ids, text and the chat template exactly as
transformers' fast tokenizer gives them, without importing transformers (about 0.7 s of every start).

`load_plain_tokenizer` returns one only where nothing in the folder would make transformers read it
differently; anything it does not know (a setting in tokenizer_config.json, a special token that
transformers would add or re-flag, a second chat template) sends the folder back to transformers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

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
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class PlainTokenizer:
    """tokenizer.json through the `tokenizers` library and the chat template through a sandboxed jinja2,
    behind the part of transformers' tokenizer interface that pagecli calls."""

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
                            add_generation_prompt: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as text; raises jinja2.TemplateError where the template rejects it, and
        ValueError without a template or messages, as transformers does."""
        if tokenize:
            raise ValueError("PlainTokenizer renders chat templates as text only; pass tokenize=False.")
        if not self.chat_template:
            raise ValueError("Cannot apply a chat template: this tokenizer has none.")
        if not messages:
            raise ValueError("Cannot apply a chat template to an empty conversation.")
        template = _compiled_template(self.chat_template)
        tools = [_plain_data(tool) for tool in tools] if tools else None  # transformers passes None for []
        return template.render(messages=[_template_message(m) for m in messages], tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **self.special_tokens)


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


# --- the chat template ----------------------------------------------------------------------------------


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to the template: keys holding None dropped, plain data only,
    and the reasoning (under any of its names) also under `thinking` and `reasoning_content`."""
    message = {key: _plain_data(value) for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _plain_data(value: Any) -> Any:
    """JSON-like data rebuilt from plain types, so the template reaches no object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) reduced to their value, their methods left behind
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(item) for item in value)
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> Any:
    return _template_environment().from_string(source)


@functools.lru_cache(maxsize=1)
def _template_environment() -> Any:
    """The jinja2 environment transformers renders chat templates in: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, the {% generation %} tag, and its tojson, raise_exception,
    strftime_now, dict and namespace. jinja2 is imported here, on the first chat prompt."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """{% generation %}...{% endgeneration %} marks the assistant's text for training masks;
        rendering shows its body, in a scope of its own as transformers' call block does."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        """namespace() without underscore attributes, which could reach Python internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
            self, *rest = args
            for name in dict(*rest, **kwargs):
                _refuse_private(name)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            _refuse_private(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _refuse_private(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")

    class TemplateDict:
        """dict() and dict.fromkeys() without the dict type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict:
            return dict.fromkeys(*args)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Not jinja's own filter, which escapes HTML characters.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(date_format: str) -> str:
        return datetime.now().strftime(date_format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env
