"""LoRA adapters chosen per request on every way in: generate's JSONL `lora`, serve's `model` (listed in
/v1/models, read by the official openai client) and `lora` fields, chat's /lora; bad flags are one sentence."""

from __future__ import annotations

import json

import openai
import pytest

from chat_helpers import cli_args, run_cli
from lora_helpers import make_adapter, one_thread  # noqa: F401 - one_thread: an autouse fixture
from pagecli.cli import main
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from serve_helpers import running_server

MESSAGES = [{"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-ways")
    return {"r8": make_adapter(tiny_llama, root / "r8", rank=8, seed=21, b_scale=1.0),
            "r4": make_adapter(tiny_llama, root / "r4", rank=4, seed=22, b_scale=1.0)}


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters):
    """Greedy tokens of MESSAGES (6 tokens) per adapter and for the base, from an engine asked directly."""
    engine = Engine(str(tiny_llama), EngineConfig(device="cpu", dtype="float32", attention="torch", num_blocks=96,
                                                  disk_cache=False, loras=tuple((n, str(p)) for n, p in adapters.items())))
    ids = engine.encode(MESSAGES)
    out = {name: engine.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora=name))[0]
           for name in (*adapters, None)}
    assert len({o.token_ids for o in out.values()}) == 3, "each adapter gives its own reply here"
    return out


def lora_flags(adapters) -> list[str]:
    return [arg for name, path in adapters.items() for arg in ("--lora", f"{name}={path}")]


def test_generate_runs_each_line_on_its_adapter(tiny_llama, adapters, expected, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": name or "base", "messages": MESSAGES, **({"lora": name} if name else {})} for name in ("r8", None, "r4")]
    lines.append({"id": "unknown", "messages": MESSAGES, "lora": "nope"})
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    # float32 as `expected` (the CPU's default dtype may be bf16, whose tokens are not float32's)
    code = main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), "-t", "0", "-n", "6", "--ignore-eos",
                 "--no-disk-cache", "--threads", "1", "--dtype", "float32", *lora_flags(adapters)])
    assert code == 0
    records = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    for name in ("r8", "r4"):
        assert records[name]["text"] == expected[name].text
    assert records["base"]["text"] == expected[None].text
    assert "No LoRA adapter named 'nope'" in records["unknown"]["error"]
    err = capsys.readouterr().err
    assert "LoRA adapters: r4 1 requests" in err and "MiB in memory (loaded on first use" in err


@pytest.mark.parametrize(("value", "message"), [("nopath", "--lora takes NAME=PATH"),
                                                ("x=/no/such/folder", "is not a folder")])
def test_a_bad_lora_flag_is_one_sentence(value, message, tiny_llama, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    code = main(["generate", str(src), "-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_llama), "--lora", value])
    assert code != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_serve_lists_adapters_as_models_and_runs_them(tiny_llama, adapters, expected):
    loras = tuple((name, str(path)) for name, path in adapters.items())
    with running_server(tiny_llama, loras=loras) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        listed = {model.id for model in client.models.list()}
        assert listed == {server.model_id, "r8", "r4"}
        for name in ("r8", "r4"):
            reply = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=6, temperature=0)
            assert expected[name].text.startswith(reply.choices[0].message.content)  # (it may stop at EOS)
        by_field = client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=6,
                                                  temperature=0, extra_body={"lora": "r4"})
        assert expected["r4"].text.startswith(by_field.choices[0].message.content)
        base = client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=6, temperature=0)
        assert expected[None].text.startswith(base.choices[0].message.content)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="No LoRA adapter named"):
            client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=2,
                                           extra_body={"lora": "nope"})
        assert dict(server.engine.stats().adapter_requests) == {"r8": 1, "r4": 2}


def test_chat_slash_lora_switches_the_adapter(tiny_llama, adapters, expected, capsys, monkeypatch):
    stdin = "/lora\n/lora r8\nHello there!\n/lora nope\n/lora off\n/exit\n"
    code, out, err = run_cli(cli_args(tiny_llama, "--no-disk-cache", *lora_flags(adapters)), stdin, capsys,
                             monkeypatch)
    assert code == 1  # /lora nope counts as a problem for scripts
    assert "adapters: r8, r4" in out + err
    assert "Replies come from LoRA adapter 'r8'" in out + err
    assert "No LoRA adapter named 'nope'" in out + err
    assert "Replies come from the base model" in out + err
