"""The quick start-up path: config.json and a generic tokenizer read without transformers' model
classes, and a model built without the random init. Each must give exactly what the slow path
gives, and fall back to it wherever it could differ."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pagecli.models.layers import RotaryEmbedding
from pagecli.models.loader import _plain_config, load_hf_config, load_tokenizer
from pagecli.models.spec import DecoderSpec
from tiny_models import ARCHS


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


def test_the_generic_tokenizer_encodes_and_templates_like_autotokenizer(tiny_llama):
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)
    assert type(ours) is type(theirs)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Très bien 日本語 🙂"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    for text in ("The quick brown fox", " leading space", "Hello world! 日本語のテキスト。", "a\n\n  b"):
        assert ours.encode(text) == theirs.encode(text)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id)


def test_loading_and_running_a_model_imports_neither_the_compiler_nor_the_model_classes(tiny_llama):
    # torch._dynamo (pulled in by random init on the meta device) and transformers' config classes
    # cost about 1.7 s and 3 s of start-up; a one-prompt run must not pay either.
    code = (
        "import sys\n"
        "from pagecli.config import EngineConfig, SamplingParams\n"
        "from pagecli.engine import Engine\n"
        f"engine = Engine({str(tiny_llama)!r}, EngineConfig(disk_cache=False))\n"
        "engine.generate(['hello'], SamplingParams(temperature=0, max_tokens=3))\n"
        "print(sorted(m for m in ('torch._dynamo', 'transformers.utils.type_validators') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
