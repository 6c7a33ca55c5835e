"""`pagecli chat --server URL` (issue 48): the chat loop with its turns answered by a running `pagecli serve`
(pagecli/chat/remote.py). The replies are the server's own Chat Completions replies for the same
conversation, the second turn's prompt comes from the server's prefix cache, the pool figures are the
server's, and mistakes (no server there, a wrong key, /format) are one sentence each."""

from __future__ import annotations

import io
import json

import openai
import pytest

from pagecli.chat.plain import PlainView, input_entries
from pagecli.chat.remote import RemoteChatController, ServerEngine
from pagecli.chat.view import ChatOptions
from pagecli.config import SamplingParams
from pagecli.errors import PagecliError
from serve_helpers import running_server

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=False)


def chat_through(url: str, lines: list[str], api_key: str | None = None) -> tuple[list[dict], str]:
    """Plain JSONL mode, as `pagecli chat --server URL --jsonl` runs it: its records and its stderr."""
    out, err = io.StringIO(), io.StringIO()
    engine = ServerEngine(url, api_key)
    controller = RemoteChatController(engine, GREEDY, PlainView(out, err, jsonl=True), options=ChatOptions())
    controller.run(input_entries(lines))
    return [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def test_replies_are_the_servers_own_and_the_second_turn_comes_from_its_cache(tiny_llama):
    with running_server(tiny_llama, num_blocks=128) as server:
        records, err = chat_through(server.base_url, ["Hello there, how are you today?", "And tomorrow?", "/stats"])
        turns = [r for r in records if "turn" in r]
        assert [t["turn"] for t in turns] == [1, 2], (records, err)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        messages = []
        for turn in turns:
            messages.append({"role": "user", "content": turn["user"]})
            expected = client.chat.completions.create(model=server.model_id, messages=messages, temperature=0,
                                                      max_tokens=8)
            assert turn["reply"] == expected.choices[0].message.content
            messages.append({"role": "assistant", "content": turn["reply"]})
        assert turns[1]["cached_tokens"] > 0 and turns[1]["prefilled_tokens"] < turns[1]["prompt_tokens"]
        assert turns[0]["completion_tokens"] > 0 and turns[0]["ttft_s"] is not None
        # the pool figures are the server's engine's own
        assert turns[1]["stats"]["num_blocks"] == server.engine.stats().num_blocks
        assert any("num_blocks" in r.get("stats", {}) for r in records if "turn" not in r)


def test_the_live_pool_view_reads_the_servers_block_states(tiny_llama):
    with running_server(tiny_llama, num_blocks=64) as server:
        engine = ServerEngine(server.base_url)
        engine.stats(include_block_states=True)  # asks the server to take block states for a while
        pieces = list(engine.stream_reply([{"role": "user", "content": "Hi"}], GREEDY, lambda: False))
        assert pieces[-1][1]["usage"]["completion_tokens"] == GREEDY.max_tokens and len(pieces) > 1
        stats = engine.stats(include_block_states=True)  # a snapshot the engine took while it stepped
        assert stats.block_states is not None and len(stats.block_states) == stats.num_blocks == 64
        assert engine.max_model_len == server.engine.max_model_len and engine.model == server.model_id


def test_mistakes_are_one_sentence(tiny_llama, tmp_path):
    with pytest.raises(PagecliError, match="Cannot reach the pagecli server at http://127.0.0.1:9"):
        ServerEngine("http://127.0.0.1:9")
    with running_server(tiny_llama, api_key="secret") as server:
        with pytest.raises(PagecliError, match="answered 401"):
            ServerEngine(server.base_url)
        schema = tmp_path / "schema.json"
        schema.write_text('{"type": "object"}')
        records, err = chat_through(server.base_url, [f"/format {schema}", "Hi"], api_key="secret")
        problems = [r["error"] for r in records if "error" in r]
        assert len(problems) == 1 and "--server" in problems[0], records
        assert [r["turn"] for r in records if "turn" in r] == [1]


def test_the_command_line_chats_through_the_server(tiny_llama, tmp_path, capsys):
    from pagecli.cli import main

    messages = tmp_path / "messages.txt"
    messages.write_text("Hello there\nAnd then?\n")
    with running_server(tiny_llama) as server:
        code = main(["chat", "--server", server.base_url, "-i", str(messages), "--jsonl", "--temperature", "0",
                     "--max-tokens", "6"])
        turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert code == 0 and [t["turn"] for t in turns] == [1, 2] and all(t["completion_tokens"] for t in turns)
    assert main(["chat", "--api-key", "k", "-i", str(messages)]) == 2  # a key without a server: a usage error


def test_generate_sends_its_lines_to_the_server_and_writes_what_a_local_run_writes(tiny_llama, tmp_path):
    from pagecli.cli import main

    lines = [{"id": "a", "messages": [{"role": "user", "content": "Hello there"}]},
             {"id": "b", "prompt": "Once upon a time", "max_tokens": 5},
             {"id": "c", "messages": [{"role": "user", "content": "Two, please"}], "n": 2, "seed": 3,
              "temperature": 0.8},
             {"id": "d", "prompt": "x", "temperature": -1}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    with running_server(tiny_llama) as server:
        code = main(["generate", str(source), "-o", str(out), "--server", server.base_url, "--temperature", "0",
                     "--max-tokens", "6", "--no-progress"])
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert code == 0 and [r["id"] for r in records] == ["a", "b", "c", "d"]
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model=server.model_id, messages=lines[0]["messages"], temperature=0,
                                              max_tokens=6)
        assert records[0]["text"] == chat.choices[0].message.content
        completion = client.completions.create(model=server.model_id, prompt="Once upon a time", temperature=0,
                                               max_tokens=5)
        assert records[1]["text"] == completion.choices[0].text and records[1]["completion_tokens"] <= 5
        assert [c["index"] for c in records[2]["choices"]] == [0, 1]
        assert records[3]["error"].startswith("line 4: ") and "temperature" in records[3]["error"]
        # run again: every line is done; nothing is sent
        assert main(["generate", str(source), "-o", str(out), "--server", server.base_url, "--temperature", "0",
                     "--max-tokens", "6", "--no-progress"]) == 0
