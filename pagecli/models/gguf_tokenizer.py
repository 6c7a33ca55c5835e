"""The converted folder's tokenizer, built by transformers from a GGUF file's tokenizer.ggml.* fields, plus what
its reading leaves out that the model's own Hugging Face tokenizer does.

A SentencePiece vocabulary (tokenizer.ggml.model "llama": pieces with scores and types, no merges) becomes
transformers' own reading of it: llama's LlamaTokenizer (the space prepended to the text's start), Gemma's
GemmaTokenizer (none prepended), Phi-3's tokenizer.json shape (prepended by a normalizer). Two things it drops are
put back in tokenizer.json: a file whose add_space_prefix is false (a llama whose tokenizer_config says
add_prefix_space false) prepends no space, and Phi-3's chat tokens eat the whitespace after them, as in its
checkpoint (the file does not record that; llama.cpp sets it by model). A byte-level BPE vocabulary ("gpt2") in a
Gemma or Phi-3 file is read as the generic fast tokenizer: those model types' own classes presume SentencePiece.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagecli.errors import ModelError
from pagecli.models import gguf_families

# GGUF architectures whose files transformers' AutoTokenizer refuses (it reads their model config first); their
# tokenizer is built from the file's tokenizer.ggml.* fields alone, as the generic fast tokenizer.
_TOKENIZER_FROM_FIELDS_ONLY = ("olmoe",)
# ... and those whose model type's tokenizer class (Gemma's, Phi-3's) presumes a SentencePiece vocabulary: it puts
# its own pre-tokenizer over a byte-level BPE one (tokenizer.ggml.model gpt2: Phi-4's, or a Gemma file made with
# another model's BPE vocabulary), which then splits text as no BPE does.
_GENERIC_FOR_BPE = tuple(gguf_families.HF_MODELS)
_SENTENCEPIECE = "llama"
# Phi-3's added tokens that keep the whitespace after them (its checkpoint's rstrip false; llama.cpp's exceptions
# to rstrip on every other control token, </s> included).
_PHI3_KEEPS_WHITESPACE = ("<unk>", "<s>", "<|endoftext|>")


def write_tokenizer(gguf_path: Path, metadata: dict[str, Any], max_positions: int, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template of `gguf_path` into `out_dir`."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    architecture = metadata.get("general.architecture")
    vocabulary = metadata.get("tokenizer.ggml.model")
    generic = architecture in _TOKENIZER_FROM_FIELDS_ONLY or (architecture in _GENERIC_FOR_BPE and vocabulary == "gpt2")
    tokenizer_class = PreTrainedTokenizerFast if generic else AutoTokenizer
    try:
        tokenizer = tokenizer_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                    trust_remote_code=False)
    except (ValueError, KeyError, OSError) as error:
        raise ModelError(
            f"transformers could not build a tokenizer from '{gguf_path}' ({error}); "
            "pass the model's Hugging Face folder or hub id instead."
        ) from error
    chat_template = metadata.get("tokenizer.chat_template")
    if chat_template and tokenizer.chat_template != chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.model_max_length = max_positions
    tokenizer.save_pretrained(str(out_dir))
    if vocabulary == _SENTENCEPIECE:
        _fit_sentencepiece(out_dir / "tokenizer.json", architecture, metadata)


def _fit_sentencepiece(tokenizer_json: Path, architecture: str, metadata: dict[str, Any]) -> None:
    """What transformers' reading of a SentencePiece vocabulary leaves out, put back in the saved tokenizer.json."""
    backend = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    if metadata.get("tokenizer.ggml.add_space_prefix") is False:
        _prepend_no_space(backend)
    if architecture == "phi3":
        _strip_after_phi3_chat_tokens(backend)
    tokenizer_json.write_text(json.dumps(backend, ensure_ascii=False, indent=2), encoding="utf-8")


def _prepend_no_space(backend: dict[str, Any]) -> None:
    """No space before the text (Metaspace's or a normalizer's), and none taken off its decoding, as
    LlamaTokenizer with add_prefix_space false has it."""
    if (backend.get("pre_tokenizer") or {}).get("type") == "Metaspace":
        backend["pre_tokenizer"]["prepend_scheme"] = "never"
    normalizer = backend.get("normalizer") or {}
    if normalizer.get("type") == "Sequence":
        normalizer["normalizers"] = [step for step in normalizer["normalizers"] if step.get("type") != "Prepend"]
    decoder = backend.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        decoder["decoders"] = [step for step in decoder["decoders"]
                               if not (step.get("type") == "Strip" and step.get("content") == " ")]


def _strip_after_phi3_chat_tokens(backend: dict[str, Any]) -> None:
    """Phi-3's special tokens (<|user|>, <|end|>, <|assistant|>, </s>, ...) eat the whitespace after them, as its
    checkpoint's tokenizer has them: the newline its chat template writes after <|user|> is not a token."""
    for token in backend.get("added_tokens", []):
        if token.get("special"):
            token["rstrip"] = token["content"] not in _PHI3_KEEPS_WHITESPACE
