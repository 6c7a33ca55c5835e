"""`pagecli serve --keep-alive` (issue 48): the server stops that long after its last request, and meanwhile
sits in a registry (pagecli/serve/registry.py) where `pagecli chat` and `pagecli generate` without --server
find it, for the same model and engine settings only; --local loads the model in the process anyway."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagecli.cli import main
from pagecli.config import load_profile
from pagecli.errors import PagecliError
from pagecli.models.source import model_identity
from pagecli.paths import servers_dir
from pagecli.serve import registry
from pagecli.serve.keep_alive import IdleClock, parse_duration
from serve_helpers import running_server

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--attention", "torch", "--threads", "1"]
CLI_ENGINE = dict(device="cpu", dtype="float32", attention="torch", threads=1, num_blocks=96)
CLI_FLAGS = [*ENGINE_FLAGS, "--num-blocks", "96"]
USING = "using the running pagecli serve at"


def entry_for(model: Path | str | None, port: int, pid: int | None = None, api_key: str | None = None,
              sampling: dict | None = None, **engine: object) -> registry.ServerEntry:
    """What a keep-alive server of `model` with these engine flags (and sampling flags) records."""
    settings = load_profile(None).engine_config(**(engine or CLI_ENGINE))
    return registry.ServerEntry(
        pid=os.getpid() if pid is None else pid, host="127.0.0.1", port=port, model=str(model or ""),
        model_identity=model_identity(None if model is None else str(model)),
        engine_digest=registry.engine_digest(settings),
        api_key_sha256=None if api_key is None else registry.key_digest(api_key), keep_alive_s=300.0,
        started=time.time(), sampling=registry.sampling_defaults(load_profile(None).sampling_params(**(sampling or {}))))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# --- the registry -----------------------------------------------------------------------------------------

def test_an_entry_is_written_whole_read_back_and_removed(tiny_llama):
    entry = entry_for(tiny_llama, 8123)
    path = registry.register(entry)
    assert path.parent == servers_dir() and [p.name for p in servers_dir().iterdir()] == [path.name]
    assert oct(path.stat().st_mode & 0o777) == oct(0o600) and oct(servers_dir().stat().st_mode & 0o777) == oct(0o700)
    assert registry.recorded() == [(path, entry)]
    assert entry.url == "http://127.0.0.1:8123" and registry.any_recorded()
    registry.unregister(path)
    assert registry.recorded() == [] and not registry.any_recorded()


def test_the_key_itself_is_never_written_only_whether_a_key_opens_the_server(tiny_llama):
    entry = entry_for(tiny_llama, 8123, api_key="sk-secret")
    text = registry.register(entry).read_text()
    assert "sk-secret" not in text
    assert entry.opens_with("sk-secret") and not entry.opens_with("sk-other") and not entry.opens_with(None)
    assert entry_for(tiny_llama, 8123).opens_with(None)


def test_stale_entries_are_ignored_and_cleaned(tiny_llama):
    gone = registry.register(entry_for(tiny_llama, free_port(), pid=dead_pid()))  # its process has ended
    refusing = registry.register(entry_for(tiny_llama, free_port()))  # a live pid, nothing listening
    broken = servers_dir() / "123-45.json"
    broken.write_text("{not json")
    with running_server(tiny_llama) as server:
        live = registry.register(entry_for(tiny_llama, port_of(server.base_url)))
        assert registry.live_servers() == [registry.recorded()[-1][1]] and live.exists()
    assert not gone.exists() and not refusing.exists() and not broken.exists()


def test_a_server_too_busy_to_answer_is_left_out_but_kept(tiny_llama):
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        path = registry.register(entry_for(tiny_llama, listener.getsockname()[1]))
        assert registry.live_servers(timeout_s=0.2) == [] and path.exists()


def test_find_server_matches_the_model_the_engine_settings_and_the_key(tiny_llama, tiny_model_factory):
    other_model = tiny_model_factory("llama", num_hidden_layers=3)
    with running_server(tiny_llama) as server:
        port = port_of(server.base_url)
        registry.register(entry_for(tiny_llama, port, api_key="k"))
        same = entry_for(tiny_llama, port)
        assert registry.find_server(same.model_identity, same.engine_digest, "k") is not None
        assert registry.find_server(same.model_identity, same.engine_digest, None) is None  # no key: not opened
        other = entry_for(other_model, port)
        assert registry.find_server(other.model_identity, other.engine_digest, "k") is None
        int8 = entry_for(tiny_llama, port, **{**CLI_ENGINE, "kv_dtype": "int8"})
        assert registry.find_server(same.model_identity, int8.engine_digest, "k") is None


def test_model_identity_names_the_folder_and_follows_its_files(tiny_llama, tmp_path):
    first = model_identity(str(tiny_llama))
    assert first == model_identity(str(tiny_llama) + "/") and str(tiny_llama.resolve()) in first
    config = tiny_llama / "config.json"
    os.utime(config, ns=(time.time_ns(), config.stat().st_mtime_ns + 10**9))  # the folder's files changed
    assert model_identity(str(tiny_llama)) != first
    assert model_identity("org/name") == "hub:org/name"
    with pytest.raises(PagecliError):
        model_identity(str(tmp_path / "missing"))


# --- the idle clock and DURATION ----------------------------------------------------------------------------

def test_the_idle_clock_counts_from_the_end_of_the_last_request_and_ignores_probes():
    now = [100.0]
    release = asyncio.Event()

    async def app(scope, receive, send):
        if scope["path"] == "/slow":
            await release.wait()

    clock = IdleClock(app, keep_alive_s=5, clock=lambda: now[0])

    async def run() -> None:
        slow = asyncio.create_task(clock({"type": "http", "path": "/slow"}, None, None))
        await asyncio.sleep(0)
        now[0] += 60
        assert clock.in_flight == 1 and not clock.expired()  # a request in flight keeps it up, however long
        release.set()
        await slow
        assert clock.idle_s() == 0 and not clock.expired()
        now[0] += 4
        await clock({"type": "http", "path": "/health"}, None, None)  # a probe is not a client
        now[0] += 1
        assert clock.expired()

    asyncio.run(run())


@pytest.mark.parametrize("text, seconds", [("0", 0), ("30s", 30), ("5m", 300), ("1h30m", 5400), ("1.5s", 1.5),
                                           ("90", 90), ("250ms", 0.25)])
def test_durations_are_read_as_ollama_writes_them(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["-1", "5x", "", "m", "nan", "1e400", "5 m"])
def test_a_bad_duration_is_one_sentence(text):
    with pytest.raises(PagecliError, match="--keep-alive"):
        parse_duration(text)


# --- the server process -------------------------------------------------------------------------------------

def test_serve_with_keep_alive_is_registered_then_exits_0_after_its_idle_time(tiny_llama):
    process = subprocess.Popen(
        [sys.executable, "-m", "pagecli", "serve", str(tiny_llama), "--port", "0", "--no-screen", *ENGINE_FLAGS,
         "--keep-alive", "1s"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "200"})
    lines = []
    try:
        for line in process.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if re.search(r"on http://127\.0\.0\.1:(\d+)/v1", line):
                break
        entries = registry.recorded()
        assert [entry.pid for _, entry in entries] == [process.pid], "".join(lines)
        entry = entries[0][1]
        assert entry.model_identity == model_identity(str(tiny_llama)) and entry.keep_alive_s == 1.0
        reply = httpx.post(entry.url + "/v1/completions", json={"model": str(tiny_llama), "prompt": "Hi",
                                                                "max_tokens": 2}, timeout=30)
        assert reply.status_code == 200
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    log = "".join(lines) + output
    assert process.returncode == 0 and "No request for 1s (--keep-alive): stopping." in log, log
    assert "Traceback" not in log and registry.recorded() == []


def test_serve_refuses_a_bad_keep_alive_before_loading_anything(capsys):
    assert main(["serve", "--keep-alive", "soon"]) == 2  # a usage error, as other bad values are
    assert "--keep-alive takes a duration" in capsys.readouterr().err


# --- chat and generate find it ------------------------------------------------------------------------------

def chat_cli(model: Path, messages: Path, *extra: str) -> list[str]:
    return ["chat", str(model), "-i", str(messages), "--jsonl", "--temperature", "0", "--max-tokens", "4",
            *CLI_FLAGS, *extra]


def test_chat_uses_a_registered_server_of_the_same_model_and_not_of_another(tiny_llama, tiny_model_factory,
                                                                            tmp_path, capsys):
    other_model = tiny_model_factory("llama", num_hidden_layers=3)
    messages = tmp_path / "messages.txt"
    messages.write_text("Hello there\n")
    with running_server(tiny_llama) as server:
        registry.register(entry_for(tiny_llama, port_of(server.base_url)))
        assert main(chat_cli(tiny_llama, messages)) == 0
        out, err = capsys.readouterr()
        assert f"{USING} {server.base_url} (keep-alive); --local to run in this process" in err
        assert "Loading model" not in err and json.loads(out.splitlines()[0])["turn"] == 1
        assert server.state.recent.turns(), "the server answered the turn"

        assert main(chat_cli(other_model, messages)) == 0
        out, err = capsys.readouterr()
        assert USING not in err and "Loading model" in err

        assert main(chat_cli(tiny_llama, messages, "--kv-dtype", "int8")) == 0  # other engine settings
        assert USING not in capsys.readouterr().err


def test_a_server_whose_sampling_defaults_would_fill_in_other_values_is_not_used(tiny_llama, tmp_path, capsys):
    messages = tmp_path / "messages.txt"
    messages.write_text("Hello there\n")
    with running_server(tiny_llama) as server:
        registry.register(entry_for(tiny_llama, port_of(server.base_url), sampling={"top_k": 40, "ignore_eos": True}))
        assert main(chat_cli(tiny_llama, messages)) == 0  # top_k 0 is not sent: the server's 40 would apply
        assert USING not in capsys.readouterr().err
        assert main(chat_cli(tiny_llama, messages, "--top-k", "5")) == 0  # sent, but ignore_eos is never sent
        assert USING not in capsys.readouterr().err
        assert main(chat_cli(tiny_llama, messages, "--top-k", "5", "--ignore-eos")) == 0
        assert USING in capsys.readouterr().err


def test_local_loads_the_model_here_even_when_a_server_runs(tiny_llama, tmp_path, capsys):
    messages = tmp_path / "messages.txt"
    messages.write_text("Hello there\n")
    with running_server(tiny_llama) as server:
        registry.register(entry_for(tiny_llama, port_of(server.base_url)))
        assert main(chat_cli(tiny_llama, messages, "--local")) == 0
        err = capsys.readouterr().err
        assert USING not in err and "Loading model" in err and not server.state.recent.turns()
        assert main(chat_cli(tiny_llama, messages, "--local", "--server", server.base_url)) == 2


def test_chat_falls_back_to_the_model_here_when_the_server_is_gone(tiny_llama, tmp_path, capsys):
    messages = tmp_path / "messages.txt"
    messages.write_text("Hello there\n")
    path = registry.register(entry_for(tiny_llama, free_port()))  # recorded, but nothing listens
    assert main(chat_cli(tiny_llama, messages)) == 0
    err = capsys.readouterr().err
    assert USING not in err and "Loading model" in err and not path.exists()


def test_generate_sends_its_lines_to_a_registered_server_and_writes_what_a_local_run_writes(tiny_llama, tmp_path,
                                                                                           capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "Once upon a time"}) + "\n"
                      + json.dumps({"id": "b", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    args = ["generate", str(source), "--model", str(tiny_llama), "--temperature", "0", "--max-tokens", "5",
            "--no-progress", *CLI_FLAGS]
    with running_server(tiny_llama) as server:
        registry.register(entry_for(tiny_llama, port_of(server.base_url)))
        assert main([*args, "-o", str(tmp_path / "served.jsonl")]) == 0
        assert USING in capsys.readouterr().err and len(server.state.recent.turns()) == 2
        assert main([*args, "-o", str(tmp_path / "local.jsonl"), "--local"]) == 0
        assert USING not in capsys.readouterr().err and len(server.state.recent.turns()) == 2

    def texts(name: str) -> list[str]:
        return [json.loads(line)["text"] for line in (tmp_path / name).read_text().splitlines()]

    assert texts("served.jsonl") == texts("local.jsonl")


# --- --keep-alive on chat and generate: start one where none runs -------------------------------------------

def test_the_flags_given_reach_a_started_server_as_the_same_settings(monkeypatch, tmp_path):
    """RunFlags.as_args: what a command was given, read back by `pagecli serve`, gives the same engine and
    sampling settings (the registry then matches the server to the command)."""
    from pagecli.cli import options as o
    from pagecli.serve import startup

    profile = tmp_path / "p.toml"
    profile.write_text("[engine]\nblock_size = 32\n[sampling]\ntop_k = 7\n")
    values = {"dtype": "float32", "disk_cache": False, "no_prefix_caching": True, "threads": 1, "kv_budget_gib": 0.5,
              "stop": ["a", "b c"], "temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "seed": 3,
              "speculate": "off"}
    flags = o.RunFlags(None, str(profile), values)
    expected = flags.settings(model="some-model")
    served = []
    monkeypatch.setattr(startup, "run_server", lambda settings, options: served.append(settings) or 0)
    assert main(["serve", "--port", "0", *flags.as_args("some-model")]) == 0
    [settings] = served
    assert settings.model == "some-model"
    assert settings.engine == expected.engine and settings.sampling == expected.sampling
    assert settings.engine.block_size == 32 and settings.sampling.top_k == 7  # the profile went along
    assert registry.engine_digest(settings.engine) == registry.engine_digest(expected.engine)


@pytest.mark.parametrize("extra", [["--local"], ["--server", "http://127.0.0.1:9"]], ids=["local", "server"])
def test_keep_alive_beside_local_or_server_is_one_sentence(extra, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    assert main(["generate", str(source), "-o", str(tmp_path / "out.jsonl"), "--keep-alive", "5m", *extra]) != 0
    assert "--keep-alive starts a server here and uses it; leave out" in capsys.readouterr().err
    assert main(["chat", "--keep-alive", "5m", *extra]) != 0
    assert "--keep-alive starts a server here and uses it; leave out" in capsys.readouterr().err
    assert registry.recorded() == []


def test_generate_with_keep_alive_starts_a_server_once_and_the_next_run_uses_it(tiny_llama, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    args = ["generate", str(source), "--model", str(tiny_llama), "--temperature", "0", "--max-tokens", "5",
            "--no-progress", "--keep-alive", "1m", *CLI_FLAGS]
    try:
        assert main([*args, "-o", str(tmp_path / "first.jsonl")]) == 0
        err = capsys.readouterr().err
        assert "Starting `pagecli serve --keep-alive 1m` in the background" in err and USING in err, err
        [(_, entry)] = registry.recorded()
        assert entry.model_identity == model_identity(str(tiny_llama)) and entry.keep_alive_s == 60.0
        assert main([*args, "-o", str(tmp_path / "second.jsonl")]) == 0
        err = capsys.readouterr().err
        assert "Starting" not in err and f"{USING} {entry.url}" in err, err
        assert [running.pid for _, running in registry.recorded()] == [entry.pid]
        assert main([*args[:-len(CLI_FLAGS) - 2], *CLI_FLAGS, "-o", str(tmp_path / "local.jsonl"), "--local"]) == 0
    finally:
        for _, running in registry.recorded():
            os.kill(running.pid, 15)

    def texts(name: str) -> list[str]:
        return [json.loads(line)["text"] for line in (tmp_path / name).read_text().splitlines()]

    assert texts("first.jsonl") == texts("second.jsonl") == texts("local.jsonl")


def test_a_server_that_cannot_start_is_one_sentence_naming_its_output(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    missing = tmp_path / "no-such-model"
    assert main(["generate", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", str(missing),
                 "--keep-alive", "1m", *CLI_FLAGS]) != 0
    err = capsys.readouterr().err
    assert "The keep-alive server stopped before it was ready" in err and "started.log" in err, err
    assert "Traceback" not in err and registry.recorded() == []


def test_a_started_server_that_does_not_match_the_command_is_stopped_and_said(tiny_llama, tmp_path, capsys,
                                                                             monkeypatch):
    """Were a setting lost on the way to the server (here: one added), the command would wait for a match forever;
    it stops the server and says so instead."""
    from pagecli.cli import options as o

    as_args = o.RunFlags.as_args
    monkeypatch.setattr(o.RunFlags, "as_args", lambda self, model: [*as_args(self, model), "--kv-dtype", "int8"])
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    assert main(["generate", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", str(tiny_llama),
                 "--keep-alive", "1m", *CLI_FLAGS]) != 0
    assert "does not run this command's settings" in capsys.readouterr().err
    deadline = time.monotonic() + 60
    while registry.recorded() and time.monotonic() < deadline:  # it unregisters as it stops
        time.sleep(0.1)
    assert registry.recorded() == []
