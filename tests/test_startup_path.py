"""The quick start-up path: config.json and a generic tokenizer read without transformers, a model
built without the random init, built kernels loaded without the builder. Each must give exactly
what the slow path gives, and fall back to it wherever it could differ."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jinja2
import pytest
import torch

from pagecli import native
from pagecli.models.layers import RotaryEmbedding
from pagecli.models.loader import _plain_config, load_hf_config, load_tokenizer
from pagecli.models.spec import DecoderSpec
from pagecli.models.tokenizer import PlainTokenizer, load_plain_tokenizer, token_ids_of
from tiny_models import ARCHS, CHATML


@pytest.mark.parametrize("arch", ARCHS)
def test_the_plain_config_gives_the_spec_and_rope_that_autoconfig_gives(tiny_model_factory, arch):
    from transformers import AutoConfig

    folder = tiny_model_factory(arch)
    auto = AutoConfig.from_pretrained(folder)
    config = load_hf_config(folder)
    assert DecoderSpec.from_hf_config(config) == DecoderSpec.from_hf_config(auto)
    spec = DecoderSpec.from_hf_config(auto)
    ours, theirs = RotaryEmbedding(config, spec.head_dim, 64), RotaryEmbedding(auto, spec.head_dim, 64)
    assert torch.equal(ours.cos, theirs.cos) and torch.equal(ours.sin, theirs.sin)
    # Scaled rope needs transformers' own definitions, so it takes the AutoConfig path.
    assert (_plain_config(folder) is None) == (arch == "llama3")


def _rewrite_config(folder, tmp_path, change) -> object:
    copy = tmp_path / "model"
    copy.mkdir()
    data = json.loads((folder / "config.json").read_text())
    change(data)
    (copy / "config.json").write_text(json.dumps(data))
    return copy


def test_a_config_missing_a_key_whose_default_differs_by_class_takes_autoconfig(tiny_model_factory, tmp_path):
    # Qwen2Config defaults use_sliding_window to False; a plain read would default it to True.
    folder = _rewrite_config(tiny_model_factory("qwen2"), tmp_path, lambda d: d.pop("use_sliding_window"))
    assert _plain_config(folder) is None


def test_a_config_naming_code_never_takes_the_plain_path(tiny_model_factory, tmp_path):
    folder = _rewrite_config(tiny_model_factory("llama"), tmp_path,
                             lambda d: d.update(auto_map={"AutoConfig": "evil.Config"}))
    assert _plain_config(folder) is None


# --- the plain tokenizer: a generic tokenizer.json without transformers ------------------------------------
CORPUS = [
    "", " ", "Hello world", " leading space", "trailing space ", "tabs\tand\nnew\r\nlines",
    "many     spaces\n\n\n   and blank lines  ", "Très bien, naïve café, Ünïcödé", "日本語のテキスト。中文。한국어",
    "emoji 🙂🚀 and a family 👩\u200d👩\u200d👧 and a flag 🇫🇷", "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more<|endoftext|>", "half <|im_start and |im_end|>", "def main():\n    print('hello')\n",
    "12345 3.14159 1e-9", "\u200b zero width, \ufffd replacement, \x00 null",
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Très bien 日本語 🙂"}],
    [{"role": "system", "content": "  spaces  "}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "<|im_start|>and 3+3?\n\n"}],
]
# Every feature of transformers' template environment, each visible in the output.
KITCHEN_SINK_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(turns=0, system=none) %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}"
    "{% if loop.index > 9 %}{% break %}{% endif %}\n"
    "  {% set ns.turns = ns.turns + 1 %}\n"
    "<|im_start|>{{ m.role }} #{{ ns.turns }} {{ m | tojson }} {{ {'k': 'é<&>'} | tojson(indent=2) }}\n"
    "{% generation %}{{ m['content'] | trim }}{% set inner = 1 %}{% endgeneration %}{{ inner is defined }}"
    "|{{ m.thinking }}|{{ m.reasoning_content }}<|im_end|>\n"
    "{% endfor %}{{ ns.system }} {{ dict(a=1) | tojson }} {{ eos_token }} {{ pad_token }} {{ unk_token is defined }}"
    " {{ tools is none }} {{ documents is none }} {{ strftime_now('%Y') }}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
KITCHEN_SINK_CHAT = [
    {"role": "system", "content": "S"}, {"role": "user", "content": "  Hi 🙂 ", "name": None},
    {"role": "assistant", "content": "ok", "reasoning": "because"},
    {"role": "user", "content": [{"type": "text", "text": "b"}]},
]
# A post-processor that writes BOS, as Llama 3's does, so that add_special_tokens matters.
BOS_POST_PROCESSOR = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
             {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
}


def _tokenizer_copy(source, tmp_path, config=None, tokenizer_json=None, files=None):
    """The tokenizer files of `source` in a new folder; config/tokenizer_json edit the parsed JSON in place."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    for name, change in (("tokenizer_config.json", config), ("tokenizer.json", tokenizer_json)):
        if change is not None:
            data = json.loads((folder / name).read_text())
            change(data)
            (folder / name).write_text(json.dumps(data))
    for name, text in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _assert_same_tokenizer(ours, theirs) -> None:
    for text in CORPUS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False) == \
                    theirs.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert ours.encode(text) == theirs.encode(text)
    vocab = ours.get_vocab()
    assert vocab == theirs.get_vocab()
    step = max(1, len(vocab) // 500)  # about 500 runs of arbitrary ids: cut characters, specials mid-text
    for start in range(0, len(vocab), step):
        ids = list(range(start, min(start + 5, len(vocab))))
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
    for chat in CHATS:
        for generation_prompt in (True, False):
            assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt) == \
                theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "model_max_length", "chat_template"):
        assert getattr(ours, name) == getattr(theirs, name), name


def _bos_writing(tiny_llama, tmp_path):
    return _tokenizer_copy(tiny_llama, tmp_path, tokenizer_json=lambda d: d.update(post_processor=BOS_POST_PROCESSOR))


def _template_in_config(tiny_llama, tmp_path):
    folder = _tokenizer_copy(tiny_llama, tmp_path, config=lambda d: d.update(chat_template=CHATML))
    (folder / "chat_template.jinja").unlink()
    return folder


def _template_file_and_config(tiny_llama, tmp_path):
    return _tokenizer_copy(tiny_llama, tmp_path, config=lambda d: d.update(chat_template="{{ messages }}"))


def _saved_by_transformers_4(tiny_llama, tmp_path):
    """What older transformers wrote: added_tokens_decoder, special_tokens_map.json, the cleanup flag (unused
    for BPE), and no model_max_length."""
    added = json.loads((tiny_llama / "tokenizer.json").read_text())["added_tokens"]
    decoder = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "added_tokens_decoder": decoder, "clean_up_tokenization_spaces": True,
              "model_input_names": ["input_ids", "attention_mask"],
              "additional_special_tokens": ["<|endoftext|>"]}
    special_map = {"bos_token": {"content": "<|im_start|>", "lstrip": False}, "eos_token": "<|im_end|>"}
    return _tokenizer_copy(tiny_llama, tmp_path, config=lambda d: (d.clear(), d.update(config)),
                           files={"special_tokens_map.json": json.dumps(special_map)})


@pytest.mark.parametrize("variant", [None, _bos_writing, _template_in_config, _template_file_and_config,
                                     _saved_by_transformers_4])
def test_the_plain_tokenizer_encodes_decodes_and_templates_like_transformers(tiny_llama, tmp_path, variant):
    from transformers import AutoTokenizer

    folder = variant(tiny_llama, tmp_path) if variant else tiny_llama
    ours = load_tokenizer(folder)
    assert isinstance(ours, PlainTokenizer)
    _assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(folder))
    if variant is _bos_writing:
        assert ours.encode("x")[0] == ours.bos_token_id != ours("x", add_special_tokens=False)["input_ids"][0]


@pytest.mark.slow
def test_the_plain_tokenizer_reads_the_embedded_model_like_transformers(smollm2_dir):
    from transformers import AutoTokenizer

    ours = load_tokenizer(smollm2_dir)
    assert isinstance(ours, PlainTokenizer)
    _assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(smollm2_dir))


def test_token_ids_of_finds_what_the_whole_vocabulary_finds(smollm2_dir):
    # The engine's stop tokens ask for a few tokens instead of building the 49,152-token dict (0.1 s of a start).
    from transformers import AutoTokenizer

    asked = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|eot_id|>", "hello", "Ġthe", "not a token"]
    ours, theirs = load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(smollm2_dir)
    whole = ours.get_vocab()
    expected = {token: whole[token] for token in asked if token in whole}
    assert token_ids_of(ours, asked) == token_ids_of(theirs, asked) == expected
    assert expected["<|im_end|>"] == 2 and "not a token" not in expected and "<|eot_id|>" not in expected


def test_the_chat_template_renders_in_the_environment_transformers_gives_it(tiny_llama):
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)
    ours.chat_template = theirs.chat_template = KITCHEN_SINK_TEMPLATE
    for generation_prompt in (True, False):
        text = ours.apply_chat_template(KITCHEN_SINK_CHAT, tokenize=False, add_generation_prompt=generation_prompt)
        assert text == theirs.apply_chat_template(KITCHEN_SINK_CHAT, tokenize=False,
                                                  add_generation_prompt=generation_prompt)
    assert "\n<|im_start|>assistant #2 " in text  # lstrip_blocks and trim_blocks ate the blank line and indent
    assert '"k": "é<&>"' in text and "\nokFalse|because|because<|im_end|>" in text


@pytest.mark.parametrize("template", [
    "{{ raise_exception('System role not supported') }}",
    "{% for %}",
    "{% set ns = namespace(_private=1) %}",
    "{% set ns = namespace() %}{% set ns._private = 1 %}",
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.append(1) }}",
])
def test_a_template_that_raises_raises_the_same_error_as_under_transformers(tiny_llama, template):
    from transformers import AutoTokenizer

    errors = []
    for tokenizer in (load_tokenizer(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)):
        tokenizer.chat_template = template
        with pytest.raises(jinja2.TemplateError) as caught:  # what PromptBuilder turns into a hint
            tokenizer.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("config,tokenizer_json,files", [
    ({"add_bos_token": True}, None, {}),  # transformers rewrites (or, since v5, ignores) the post-processor
    ({"add_eos_token": True}, None, {}),
    ({"legacy": False}, None, {}),
    ({"add_prefix_space": True}, None, {}),
    ({"split_special_tokens": True}, None, {}),
    ({"image_token": "<|endoftext|>"}, None, {}),  # a model-specific special token: a template variable
    ({"pad_token": "<pad>"}, None, {}),  # not in the vocabulary: transformers adds it
    ({"additional_special_tokens": ["<tool>"]}, None, {}),
    ({"eos_token": {"content": "<|im_end|>", "__type": "AddedToken"}}, None, {}),
    ({"added_tokens_decoder": {"2": {"content": "<|im_end|>", "special": True, "lstrip": True}}}, None, {}),
    ({"chat_template": [{"name": "default", "template": "x"}]}, None, {}),
    ({"tokenizer_class": "GPT2TokenizerFast"}, None, {}),
    ({}, {"truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}}, {}),
    ({}, {"added_tokens": []}, {}),  # the named special tokens are no longer added tokens
    ({}, None, {"special_tokens_map.json": json.dumps({"eos_token": "<|endoftext|>"})}),
    ({}, None, {"added_tokens.json": json.dumps({"<tool>": 384})}),
    ({}, None, {"additional_chat_templates/tools.jinja": "{{ messages }}"}),
])
def test_a_setting_transformers_would_act_on_keeps_the_transformers_path(tiny_llama, tmp_path, config, tokenizer_json,
                                                                          files):
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    folder = _tokenizer_copy(tiny_llama, tmp_path, config=lambda d: d.update(config),
                             tokenizer_json=tokenizer_json and (lambda d: d.update(tokenizer_json)), files=files)
    assert load_plain_tokenizer(folder) is None
    loaded, reference = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert isinstance(loaded, PreTrainedTokenizerBase)
    for text in CORPUS:
        assert loaded(text)["input_ids"] == reference(text)["input_ids"]
    assert loaded.get_vocab() == reference.get_vocab()


def test_loading_and_running_a_model_imports_neither_the_compiler_nor_transformers(tiny_llama):
    # torch._dynamo (pulled in by random init on the meta device), transformers (its config classes, or
    # only its tokenizer), jinja2 and torch's extension builder (loading built kernels) cost about 1.7 s,
    # 0.7-3 s, 0.07 s and 0.3 s of start-up; a one-prompt run without a chat template pays none of them.
    watched = ("torch._dynamo", "transformers", "jinja2", "torch.utils.cpp_extension")
    if native.cpu_ops() is None:  # built here, once, so that the child only loads them
        watched = watched[:-1]
    code = (
        "import sys\n"
        "from pagecli.config import EngineConfig, SamplingParams\n"
        "from pagecli.engine import Engine\n"
        f"engine = Engine({str(tiny_llama)!r}, EngineConfig(disk_cache=False))\n"
        "engine.generate(['hello'], SamplingParams(temperature=0, max_tokens=3))\n"
        f"print(sorted(m for m in {watched!r} if m in sys.modules))\n"
        "engine.generate([[{'role': 'user', 'content': 'hi'}]], SamplingParams(temperature=0, max_tokens=3))\n"
        f"print(sorted(m for m in {watched!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-2:] == ["[]", "['jinja2']"]  # a chat template needs jinja2 only


def test_built_kernels_are_imported_directly_only_beside_the_stamp_of_a_finished_build(tmp_path):
    if native.cpu_ops() is None:
        pytest.skip(f"no CPU kernels here: {native.unavailable_reason()}")
    level = native.level()
    assert (native.build_dir(level) / native._BUILT_STAMP).is_file() and native.is_built(level)
    library = native.build_dir(level) / f"{native._module_name(level)}.so"
    (tmp_path / library.name).symlink_to(library)
    assert native._load_built(tmp_path, level) is None  # no stamp: a build may be rewriting the library
