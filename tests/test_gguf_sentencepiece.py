"""GGUF files whose vocabulary is SentencePiece's (tokenizer.ggml.model "llama": pieces with scores and types, no
merges), as llama.cpp's own convert_hf_to_gguf.py writes them from tiny random llama (one of them prepending no
space), Gemma 2, Gemma 3 and Phi-3 models whose tokenizer is a small byte-fallback SentencePiece model trained here.
The tokenizer pagecli builds from the file gives the model folder's Hugging Face tokenizer's ids (leading spaces,
newlines, bytes for what the pieces lack, digits, the special tokens), its text back, its BOS/EOS/pad ids and chat
template, the SentencePiece model's own split of plain text, and the folder's greedy tokens and stop tokens.

Each folder's tokenizer files are shaped as its family's checkpoints ship them: tokenizer.model, a tokenizer.json
whose normalizer prepends the space (Llama 2's, Mistral's, Phi-3's; transformers reads Phi-3's as it is, and
rebuilds llama's from its LlamaTokenizer class and `legacy` flag) or prepends none (Gemma's), and a
tokenizer_config.json that lists the added tokens (Phi-3's chat tokens eating the whitespace after them)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from engine_probes import float32_engine
from llama_cpp_files import LLAMA_CPP, run_converter, save_random_model
from pagecli.config import SamplingParams
from pagecli.engine import detokenizer
from pagecli.models.loader import load_tokenizer
from pagecli.models.source import resolve_model

spm = pytest.importorskip("sentencepiece", reason="sentencepiece (the converter needs it) is not installed")
pytestmark = pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                                reason="llama.cpp's source is not here")

VOCAB_PIECES = 400
_README = Path(__file__).resolve().parents[1] / "README.md"
# What the converter cannot say otherwise, as llama.cpp reads its Gemma files (test_gguf_gemma_phi3's OVERRIDES).
_MODEL_OVERRIDES = {
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}
TEXTS = [
    "Hello  world", " one leading space", "  two leading spaces", "trailing spaces  ", "a\nb\n\n c",
    "\ttab\tand \n  mixed ", "日本語のテキスト 😀 é ß", "12345 x 3.14 and 2026", "Paged attention keeps the KV cache.",
    "<start_of_turn>user\nhi<end_of_turn>", "<|user|>\nhi<|end|>\n<|assistant|>", "<s>[INST] hi [/INST]</s>", "", " ",
    "\n",
]
MESSAGES = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": " Hi! 😀"},
            {"role": "user", "content": "What is 12 + 30?\n"}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _added(content: str, special: bool = True, rstrip: bool = False) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": rstrip, "single_word": False,
            "special": special}


@dataclass(frozen=True)
class Family:
    """How one family's checkpoints hold their SentencePiece tokenizer."""

    arch: str  # the tiny model's (tiny_models.tiny_config)
    pieces: dict  # the SentencePiece trainer's settings: special pieces, whether a space is prepended
    tokenizer_config: dict  # tokenizer_config.json
    added: list[str] = field(default_factory=list)  # added tokens past the pieces
    space_by_normalizer: bool = True  # tokenizer.json prepends the space with a normalizer (Gemma's prepends none)
    padded_rows: int = 0  # embedding rows past the vocabulary (the converter names them [PADn])


_LLAMA_PIECES = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True)
_GEMMA_PIECES = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
                     user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"], add_dummy_prefix=False)
_LLAMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                   "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
_GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
                   "m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                   "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_PHI3_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_LLAMA_ADDED = {str(i): _added(token) for i, token in enumerate(["<unk>", "<s>", "</s>"])}
_LLAMA_CONFIG = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
                 "eos_token": "</s>", "unk_token": "<unk>", "legacy": False, "chat_template": _LLAMA_TEMPLATE,
                 "added_tokens_decoder": _LLAMA_ADDED}
_GEMMA = Family("gemma2", _GEMMA_PIECES, {
    "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>",
    "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": _GEMMA_TEMPLATE,
    "added_tokens_decoder": {str(i): _added(token) for i, token in enumerate(
        ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"])}},
    space_by_normalizer=False)
# Phi-3 mini's chat tokens, added past Llama 2's pieces; all but <|endoftext|> eat the whitespace after them
_PHI3_ADDED = [("<|endoftext|>", False), ("<|assistant|>", True), ("<|end|>", True), ("<|user|>", True)]
FAMILIES = {
    "llama": Family("llama", _LLAMA_PIECES, _LLAMA_CONFIG),
    # a llama whose tokenizer prepends no space (tokenizer_config's add_prefix_space; the file's add_space_prefix)
    "llama-no-space-prefix": Family("llama", {**_LLAMA_PIECES, "add_dummy_prefix": False},
                                    {**_LLAMA_CONFIG, "add_prefix_space": False}, space_by_normalizer=False),
    "gemma2": _GEMMA,
    "gemma3": replace(_GEMMA, arch="gemma3"),
    "phi3": Family("phi3", _LLAMA_PIECES, {
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False, "bos_token": "<s>",
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>", "legacy": False,
        "chat_template": _PHI3_TEMPLATE,
        "added_tokens_decoder": {**_LLAMA_ADDED, **{str(VOCAB_PIECES + i): _added(token, rstrip=rstrip)
                                                    for i, (token, rstrip) in enumerate(_PHI3_ADDED)}}},
        added=[token for token, _ in _PHI3_ADDED], padded_rows=3),
}


def trained_pieces(trainer_settings: dict) -> bytes:
    """A byte-fallback BPE SentencePiece model of VOCAB_PIECES pieces trained on the README, digits split and
    whitespace kept as llama's and Gemma's are."""
    lines = [line for line in _README.read_text(encoding="utf-8")[:20000].splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=VOCAB_PIECES, model_type="bpe",
        byte_fallback=True, split_digits=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        allow_whitespace_only_pieces=True, character_coverage=1.0, minloglevel=2, **trainer_settings)
    return model.getvalue()


def write_tokenizer_files(folder: Path, family: Family) -> None:
    """tokenizer.model, tokenizer.json and tokenizer_config.json in `folder`, as `family`'s checkpoints have them."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(trained_pieces(family.pieces))
    (folder / "tokenizer_config.json").write_text(json.dumps(family.tokenizer_config))
    tokenizer = AutoTokenizer.from_pretrained(folder)  # transformers' conversion of the pieces, BOS as config says
    tokenizer.add_special_tokens({"additional_special_tokens": family.added})
    if family.space_by_normalizer:
        backend = tokenizer.backend_tokenizer
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        backend.pre_tokenizer = None
    tokenizer.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(family.tokenizer_config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """FAMILIES' name -> (model folder, its F32 GGUF file), each made on first use."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(name: str) -> tuple[Path, Path]:
        if name not in made:
            from transformers import AutoTokenizer

            family = FAMILIES[name]
            root = tmp_path_factory.mktemp(f"spm-{name}")
            folder = root / family.arch
            write_tokenizer_files(folder, family)
            reference = AutoTokenizer.from_pretrained(folder)
            save_random_model(folder, family.arch, vocab_size=len(reference) + family.padded_rows,
                              intermediate_size=64, bos_token_id=reference.bos_token_id,
                              eos_token_id=reference.eos_token_id, pad_token_id=reference.pad_token_id,
                              **_MODEL_OVERRIDES.get(family.arch, {}))
            made[name] = folder, run_converter(folder, root / f"{family.arch}.f32.gguf", "f32")
        return made[name]

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_the_files_tokenizer_gives_the_folders_ids_text_and_special_tokens(family, converted):
    from transformers import AutoTokenizer

    folder, path = converted(family)
    reference = AutoTokenizer.from_pretrained(folder)
    from_file = load_tokenizer(resolve_model(str(path)))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(from_file, name) == getattr(reference, name), name
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        assert from_file(text)["input_ids"] == ids, text
        assert from_file(text, add_special_tokens=False)["input_ids"] == reference(text, add_special_tokens=False)[
            "input_ids"], text
        for skip in (False, True):
            assert from_file.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    every_piece = list(range(len(reference)))
    assert from_file.decode(every_piece) == reference.decode(every_piece)
    chat = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert from_file.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == chat
    assert from_file(chat, add_special_tokens=False)["input_ids"] == reference(chat, add_special_tokens=False)[
        "input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_files_pieces_split_text_as_the_sentencepiece_model_does(family, converted):
    """The merges transformers rebuilds from the file's pieces and scores are the SentencePiece model's own: text
    that starts with no whitespace and holds no special token splits as sentencepiece splits it."""
    folder, path = converted(family)
    pieces = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    from_file = load_tokenizer(resolve_model(str(path)))
    plain = [text for text in TEXTS if text.strip() and not text[0].isspace() and "<" not in text]
    assert len(plain) > 5
    for text in plain:
        assert from_file(text, add_special_tokens=False)["input_ids"] == pieces.encode(text), text


@pytest.mark.parametrize("family", FAMILIES)
def test_the_file_gives_the_folders_greedy_tokens_and_stop_tokens(family, converted, monkeypatch):
    # Text deltas by decoding windows: tokenizers' DecodeStream raises on some runs of byte pieces that are no
    # UTF-8 (a random model's output), from the folder as from the file; the tokens are what this test compares.
    monkeypatch.setattr(detokenizer, "_rust_tokenizer", lambda tokenizer: None)
    folder, path = converted(family)
    prompts = ["Paged attention keeps the KV cache", " 日本語 😀\n12"]
    runs = {}
    for model in (path, folder):
        with float32_engine(str(model)) as running:
            runs[model] = ([list(out.token_ids) for out in running.generate(prompts, GREEDY)],
                           running.stop_token_ids)
    tokens, stop_token_ids = runs[path]
    assert len({token for row in tokens for token in row}) > 3
    assert runs[path] == runs[folder]
    vocab = load_tokenizer(folder).get_vocab()
    ends = {vocab[token] for token in ("<end_of_turn>", "<|end|>") if token in vocab}  # Gemma's, Phi-3's turn ends
    assert ends | {vocab[FAMILIES[family].tokenizer_config["eos_token"]]} <= stop_token_ids
