"""Input is read with bounded memory: a line-length limit (--max-line-bytes, default 4 MiB) applied while
reading, so an endless line (/dev/zero) or a huge one ends the run at once with one sentence; UTF-16 and
UTF-32 text with a BOM is read as text, and UTF-16 without one is refused by name."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from chat_helpers import cli_args, run_cli
from fake_engine import echo_engine  # noqa: F401 - the fixture

from pagecli.cli import main
from pagecli.batch.input_lines import DEFAULT_MAX_LINE_BYTES, LineTooLong, read_lines, split_chunks


def generate(src: Path | str, dst: Path | str, *extra: str) -> int:
    return main(["generate", str(src), "-o", str(dst), "-m", "echo", *extra])


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("Error:")]


class CountingStream(io.RawIOBase):
    """An endless line of `byte`, counting what was read from it."""

    def __init__(self, byte: bytes = b"x") -> None:
        self.byte = byte
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        buffer[:] = self.byte * len(buffer)
        self.read_bytes += len(buffer)
        return len(buffer)


def test_an_endless_line_is_refused_after_reading_about_the_limit():
    stream = CountingStream()
    with pytest.raises(LineTooLong, match=r"Line 1 of 'endless' is longer than 1,000 bytes \(--max-line-bytes\)"):
        read_lines(io.BufferedReader(stream), "'endless'", 1000)
    assert stream.read_bytes <= 2 << 20, "one chunk at most past the limit"


def test_the_limit_counts_each_line_and_names_the_long_one():
    assert list(split_chunks([b"abc\n", b"de", b"f\ngh"], "x", 3)) == [b"abc", b"def", b"gh"]
    with pytest.raises(LineTooLong, match="Line 2 of"):
        list(split_chunks([b"abc\nabcd\n"], "x", 3))


def test_generate_dev_zero_ends_at_once_with_one_sentence_and_bounded_memory(tmp_path):
    """Reproducer: `generate /dev/zero` grew without limit (7.5 GB in 10 s). A child under a 4 GiB address
    space limit reads with the default limit and ends in seconds."""
    script = ("import resource, sys\n"
              "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
              "from pagecli.cli import main\n"
              f"sys.exit(main(['generate', '/dev/zero', '-o', {str(tmp_path / 'out.jsonl')!r}, '-m', 'echo']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"Line 1 of '/dev/zero' is longer than {DEFAULT_MAX_LINE_BYTES:,} bytes" in done.stderr
    assert "Unexpected" not in done.stderr and not (tmp_path / "out.jsonl").exists()


def test_a_50_mb_line_is_refused_without_reading_it_whole(echo_engine, tmp_path, capsys):
    """Reproducer: a 50 MB single line peaked at 8 GB before it was refused."""
    src = tmp_path / "big.jsonl"
    with open(src, "wb") as f:
        f.write(b'{"prompt": "' + b"a" * (50 << 20) + b'"}\n')
    tracemalloc.start()
    try:
        assert generate(src, tmp_path / "out.jsonl") == 2
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    [line] = error_lines(capsys.readouterr().err)
    assert "Line 1 of" in line and "--max-line-bytes" in line
    assert peak_bytes < 24 << 20, "about the limit and a chunk, not the line"
    assert echo_engine.runs == []


def test_max_line_bytes_is_settable(echo_engine, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("short\n" + "x" * 100 + "\n")
    assert generate(src, tmp_path / "out.jsonl", "--max-line-bytes", "50") == 2
    assert "Line 2 of" in error_lines(capsys.readouterr().err)[0]
    assert generate(src, tmp_path / "out.jsonl", "--max-line-bytes", "100") == 0


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "utf-32-be"])
def test_utf16_and_utf32_with_a_bom_are_read_as_text(echo_engine, tmp_path, encoding):
    """Reproducer: a UTF-16 file was read as NUL-riddled prompts (3 completions for 2 lines)."""
    src = tmp_path / "in.txt"
    text = "héllo wörld\r\nsecond ✓\n"
    bom = {"utf-16-be": "\ufeff", "utf-32-be": "\ufeff"}.get(encoding, "")  # utf-16 / utf-32 write their own
    src.write_bytes((bom + text).encode(encoding))
    assert generate(src, tmp_path / "out.jsonl") == 0
    assert [r["text"] for r in records(tmp_path / "out.jsonl")] == ["echo:héllo wörld", "echo:second ✓"]


def test_utf16_without_a_bom_is_refused_by_name(echo_engine, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_bytes("hello\nworld\n".encode("utf-16-le"))
    assert generate(src, tmp_path / "out.jsonl") == 2
    assert "looks like UTF-16 text without a byte order mark" in error_lines(capsys.readouterr().err)[0]


def test_utf8_with_a_bom_and_stray_bytes_still_reads():
    lines = read_lines(io.BytesIO(b"\xef\xbb\xbfone\r\ntw\xffo\n\n"), "x", 100)
    assert lines == ["one", "tw\ufffdo", ""]


def test_chat_input_dev_zero_ends_with_one_sentence(tiny_llama, capsys, monkeypatch):
    """Reproducer: `chat -i /dev/zero` grew without limit."""
    code, out, err = run_cli(cli_args(tiny_llama, "--input", "/dev/zero", "--max-line-bytes", "100000"), "",
                             capsys, monkeypatch)
    assert code != 0
    assert "Input line 1 is longer than 100,000 bytes (--max-line-bytes)" in err
    assert "Unexpected" not in err


def test_the_flags_default_is_the_readers():
    import pagecli.cli.chat as chat_cli

    assert chat_cli._MAX_LINE_BYTES == DEFAULT_MAX_LINE_BYTES
    help_text = subprocess.run([sys.executable, "-m", "pagecli", "generate", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "--max-line-bytes" in help_text and str(DEFAULT_MAX_LINE_BYTES) in help_text


@pytest.mark.parametrize("data", [b"", b"a", b"ab\n", b"\x00\x00\x00"])
def test_inputs_shorter_than_a_bom_read(data):
    assert read_lines(io.BytesIO(data), "x", 100) == data.decode().splitlines()


def test_a_schema_file_is_read_with_a_bound():
    """Reproducer: `/format /dev/zero` (and --json-schema /dev/zero) grew without limit."""
    from pagecli.config.structured import spec_from_schema_file
    from pagecli.errors import PagecliError

    with pytest.raises(PagecliError, match="JSON schema file '/dev/zero' is larger than 16 MiB"):
        spec_from_schema_file("/dev/zero")


def test_chat_format_dev_zero_is_one_problem_and_the_chat_goes_on(tiny_llama):
    from chat_helpers import GREEDY, RecordingView, make_engine

    from pagecli.chat.controller import ChatController

    view = RecordingView()
    chat = ChatController(make_engine(tiny_llama), GREEDY, view)
    chat.handle_line("/format /dev/zero")
    assert len(view.problems) == 1 and "larger than 16 MiB" in view.problems[0]
    chat.handle_line("hello")
    assert len(view.records) == 1
