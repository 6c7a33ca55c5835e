"""Properties of `pagecli generate` over arbitrary files (hypothesis), with EchoEngine (fake_engine.py) in
place of a model so that each example takes milliseconds:

- any bytes as an existing output that is not a pagecli results file: refused, non-zero, byte-identical;
- any bytes as the input: one record per non-blank input line, in input order, or one clear error
  before anything is written.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from fake_engine import EchoEngine
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagecli.cli import main

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def echo(monkeypatch):
    monkeypatch.setattr("pagecli.engine.Engine", EchoEngine)


def generate(src: Path, dst: Path) -> int:
    return main(["generate", str(src), "-o", str(dst), "-m", "echo"])


# --- an output that is not ours is left alone -----------------------------------------------------------
def could_be_a_results_file(data: bytes) -> bool:
    """A deliberately loose test: every pagecli results file is empty, names a `line`, or is one cut-off record."""
    return not data or b'"line"' in data or data.startswith(b'{"id": ')


@FAST
@given(data=st.binary(max_size=400) | st.text(max_size=200).map(str.encode))
@example(data=b"\n")
@example(data=b"hello")
@example(data=b'{"id": "x"}\n')
@example(data=b'{"text": "x", "finish_reason": "stop"}\n')
@example(data=b"\xff\xfe\n")
@example(data=b'[{"id": "line-1"}]\n{"id": ')
def test_any_output_that_is_not_a_results_file_is_refused_and_left_byte_identical(data, capsys):
    if could_be_a_results_file(data):
        return
    with tempfile.TemporaryDirectory() as folder:
        src, dst = Path(folder) / "in.txt", Path(folder) / "out.jsonl"
        src.write_text("hello\nworld\n")
        dst.write_bytes(data)
        assert generate(src, dst) == 2
        assert dst.read_bytes() == data
        assert sorted(p.name for p in Path(folder).iterdir()) == ["in.txt", "out.jsonl"]
    err = capsys.readouterr().err
    assert "is not a pagecli results file: its line" in err and "Unexpected" not in err


# --- any input: a record per non-blank line, or a clear error before writing --------------------------------
def non_blank_line_numbers(data: bytes) -> list[int]:
    """Line numbers as an editor counts them: lines end at b"\\n" (a \\r before it and a leading BOM aside)."""
    lines = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return [n for n, raw in enumerate(lines, start=1) if raw.removesuffix(b"\r").decode("utf-8", "replace").strip()]


tricky_text = st.text(st.sampled_from("ab {}[]\"\\:,0123456789\r\x0c\x85\u2028\u2029\ufeff\ud800é"), max_size=30)
json_lines = st.builds(lambda prompt, extra: json.dumps({"prompt": prompt, **extra}, ensure_ascii=False),
                       tricky_text, st.dictionaries(st.sampled_from(["id", "max_tokens", "messages", "seed"]),
                                                    st.integers(-3, 10**6) | st.text(max_size=5), max_size=2))
line_ends = st.sampled_from([b"\n", b"\r\n"])
boms = st.sampled_from([b"", b"\xef\xbb\xbf"])
inputs = (st.binary(max_size=300)
          | st.builds(lambda lines, end, bom: bom + end.join(s.encode("utf-8", "surrogatepass") for s in lines) + end,
                      st.lists(json_lines | tricky_text, max_size=6), line_ends, boms))


@FAST
@given(data=inputs)
@example(data=b"\n \n\r\n")
@example(data=b'{"prompt": "one\xe2\x80\xa8two"}\n{"prompt": "x\x0cy"}\n')
@example(data=b"[" * 3000 + b"\n" + b"7" * 5000 + b"\n")
@example(data=b"\xef\xbb\xbf{\"prompt\": \"hi\"}\r\n\x85\r\n")
def test_any_input_gets_one_record_per_non_blank_line_or_a_clear_error_before_writing(data, capsys):
    expected = non_blank_line_numbers(data)
    with tempfile.TemporaryDirectory() as folder:
        src, dst = Path(folder) / "in", Path(folder) / "out.jsonl"
        src.write_bytes(data)
        code = generate(src, dst)
        err = capsys.readouterr().err
        assert "Unexpected" not in err and "Traceback" not in err
        if not expected:
            assert code == 2 and "There are no requests in" in err and not dst.exists()
            return
        assert code in (0, 1), err
        out = [json.loads(line) for line in dst.read_bytes().split(b"\n")[:-1]]
        assert [r["line"] for r in out] == expected
        assert sorted(p.name for p in Path(folder).iterdir()) == ["in", "out.jsonl"], "no lock, no journal left"
