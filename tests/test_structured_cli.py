"""Structured output from `pagecli generate`: `response_format` on JSONL and OpenAI batch lines, `--json-schema FILE`
for the whole file, a bad schema as that line's error record; and greedy output that does not depend on batching,
chunked prefill, preemption or prefix hits."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from pagecli.cli import main

SCHEMA_FILE = Path(__file__).parent / "data" / "person.schema.json"
SCHEMA = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
# What a random tiny model can finish: bounded values (its strings would run to max_tokens).
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
         "required": ["ok", "n"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL, "strict": True}}
TOPICS = ["fox", "blocks", "cache", "tea", "rain", "code", "jazz", "moon"]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


def generate(model, src: Path, dst: Path, *extra: str) -> int:
    return main(["generate", str(src), "-o", str(dst), "-m", str(model), "--dtype", "float32", "-t", "0", "-n", "300",
                 "--no-progress", "--no-disk-cache", *extra])


def sixty_four_lines() -> list[dict]:
    """64 lines, half chat and half prompts, sharing prefixes (so prefix hits happen), all constrained."""
    lines = []
    for i in range(64):
        topic = TOPICS[i % len(TOPICS)]
        if i % 2:
            lines.append({"messages": [{"role": "user", "content": f"Rate {topic} #{i} as JSON."}],
                          "response_format": RESPONSE_FORMAT})
        else:
            lines.append({"prompt": f"A JSON verdict on {topic}, case {i}: ", "response_format": RESPONSE_FORMAT})
    return lines


def test_response_format_on_every_line_of_a_64_line_file_parses_and_validates(tiny_llama, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", sixty_four_lines())
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    out = records(tmp_path / "out.jsonl")
    assert len(out) == 64
    for record in out:
        assert record["finish_reason"] == "stop", record
        jsonschema.validate(json.loads(record["text"]), SMALL)


@pytest.mark.parametrize("variant", [
    ["--max-num-seqs", "1"],  # no batching
    ["--max-num-batched-tokens", "7"],  # chunked prefill
    ["--block-size", "4", "--num-blocks", "160"],  # preemption: far fewer blocks than the batch wants
])
def test_greedy_constrained_output_does_not_depend_on_how_the_batch_runs(tiny_llama, tmp_path, variant):
    src = write_lines(tmp_path / "in.jsonl", sixty_four_lines()[:16])
    assert generate(tiny_llama, src, tmp_path / "batched.jsonl") == 0
    assert generate(tiny_llama, src, tmp_path / "variant.jsonl", *variant) == 0
    batched, other = records(tmp_path / "batched.jsonl"), records(tmp_path / "variant.jsonl")
    assert [r["text"] for r in other] == [r["text"] for r in batched]


def test_prefix_hits_from_the_disk_store_do_not_change_constrained_output(tiny_llama, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", sixty_four_lines()[:8])
    base = ["generate", str(src), "-m", str(tiny_llama), "--dtype", "float32", "-t", "0", "-n", "300", "--no-progress",
            "--cache-prefix"]
    assert main([*base, "-o", str(tmp_path / "a.jsonl")]) == 0
    assert main([*base, "-o", str(tmp_path / "b.jsonl")]) == 0
    first, second = records(tmp_path / "a.jsonl"), records(tmp_path / "b.jsonl")
    assert sum(r["cached_tokens"] for r in second) > 0, "the second run was meant to hit the prefix store"
    assert [r["text"] for r in second] == [r["text"] for r in first]


def test_openai_batch_lines_take_response_format_json_object_and_schema(tiny_llama, tmp_path):
    def batch_line(custom_id: str, response_format: dict) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "Answer in JSON."}],
                         "response_format": response_format}}

    src = write_lines(tmp_path / "batch.jsonl", [batch_line("schema", RESPONSE_FORMAT),
                                                 batch_line("object", {"type": "json_object"}),
                                                 batch_line("text", {"type": "text"})])
    assert generate(tiny_llama, src, tmp_path / "out.jsonl", "-n", "400") == 0
    schema, obj, text = records(tmp_path / "out.jsonl")
    jsonschema.validate(json.loads(schema["text"]), SMALL)
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["text"]), dict)
    else:  # a random model may nest objects until max_tokens; what it wrote is still a JSON object's start
        assert obj["text"].lstrip().startswith("{")
    assert "error" not in text


def test_a_bad_schema_is_that_lines_error_and_the_others_run(tiny_llama, tmp_path):
    lines = [{"prompt": "fox", "response_format": RESPONSE_FORMAT},
             {"prompt": "fox", "response_format": {"type": "json_schema", "json_schema": {
                 "name": "bad", "schema": {"type": "array", "uniqueItems": True}}}},
             {"prompt": "fox", "response_format": {"type": "xml"}},
             {"prompt": "fox", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}]
    src = write_lines(tmp_path / "in.jsonl", lines)
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    good, unique, xml, nope = records(tmp_path / "out.jsonl")
    jsonschema.validate(json.loads(good["text"]), SMALL)
    assert unique["error"].startswith("line 2: ") and "'uniqueItems'" in unique["error"]
    assert xml["error"].startswith("line 3: ") and "response_format.type" in xml["error"]
    assert nope["error"].startswith("line 4: ") and 'Unsupported type "nope"' in nope["error"]


def test_json_schema_flag_constrains_the_whole_file_and_a_line_can_opt_out(tiny_llama, tmp_path):
    small = tmp_path / "small.schema.json"
    small.write_text(json.dumps(SMALL), encoding="utf-8")
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": "fox"}, {"prompt": "tea"},
                                              {"prompt": "fox", "response_format": {"type": "text"},
                                               "max_tokens": 5, "ignore_eos": True}])
    assert generate(tiny_llama, src, tmp_path / "out.jsonl", "--json-schema", str(small)) == 0
    fox, tea, free = records(tmp_path / "out.jsonl")
    for record in (fox, tea):
        jsonschema.validate(json.loads(record["text"]), SMALL)
    assert free["completion_tokens"] == 5


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_a_bad_schema_file_is_one_clear_line(tiny_llama, tmp_path, capsys, content, message):
    schema = tmp_path / "schema.json"
    if content is not None:
        schema.write_text(content, encoding="utf-8")
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": "fox"}])
    assert generate(tiny_llama, src, tmp_path / "out.jsonl", "--json-schema", str(schema)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_smollm2_json_schema_file_every_answer_validates(smollm2_dir, tmp_path):
    people = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Isaac Newton", "Hedy Lamarr"]
    src = write_lines(tmp_path / "in.jsonl", [
        {"messages": [{"role": "user", "content": f"Describe {p} as JSON: name, age at death, languages."}]}
        for p in people])
    assert generate(smollm2_dir, src, tmp_path / "out.jsonl", "-n", "120", "--json-schema", str(SCHEMA_FILE)) == 0
    for record in records(tmp_path / "out.jsonl"):
        assert record["finish_reason"] == "stop", record
        jsonschema.validate(json.loads(record["text"]), SCHEMA)


def test_chat_format_command_constrains_replies_until_off(tiny_llama, tmp_path):
    from chat_helpers import RecordingView, make_engine

    from pagecli.chat.controller import ChatController
    from pagecli.config import SamplingParams

    small = tmp_path / "small.schema.json"
    small.write_text(json.dumps(SMALL), encoding="utf-8")
    view = RecordingView()
    chat = ChatController(make_engine(tiny_llama, num_blocks=256), SamplingParams(temperature=0, max_tokens=300), view)
    chat.handle_line("/format")
    assert view.notices[-1].startswith("Replies are free text")
    chat.handle_line(f"/format {small}")
    assert view.notices[-1].startswith("Replies follow a json schema")
    chat.handle_line("Rate this.")
    jsonschema.validate(json.loads(chat.conversation.turns[-1].assistant), SMALL)
    chat.handle_line("/set max_tokens=290")  # /set keeps the format
    assert chat.sampling.structured is not None and chat.sampling.max_tokens == 290
    chat.handle_line("/format off")
    assert chat.sampling.structured is None and view.notices[-1].startswith("Replies are free text")
    chat.handle_line("/format json")
    assert chat.sampling.structured.kind == "json_object"
    assert not view.problems
    unique = tmp_path / "unique.schema.json"
    unique.write_text('{"type": "array", "uniqueItems": true}', encoding="utf-8")
    chat.handle_line(f"/format {unique}")
    assert "'uniqueItems'" in view.problems[-1]
    chat.handle_line(f"/format {tmp_path / 'missing.json'}")
    assert "does not exist" in view.problems[-1]
    assert chat.sampling.structured.kind == "json_object"  # a refused /format changes nothing


def test_serve_refuses_a_json_schema_for_all_requests(tiny_llama, capsys):
    assert main(["serve", "-m", str(tiny_llama), "--json-schema", str(SCHEMA_FILE)]) == 2
    assert "takes a JSON schema per request" in capsys.readouterr().err
