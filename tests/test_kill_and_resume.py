"""`pagecli generate` killed at random points and run again until done loses and duplicates nothing.

Each run is a real process: SIGKILL while the model loads and while results are being written,
SIGINT for a clean stop with a summary, then a last run that completes. After every run the file
holds whole JSON lines, in input order, each line once; at the end, exactly the records of a run
that was never interrupted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagecli.cli import main

NUM_PROMPTS = 30
GREEDY = ["-t", "0", "-n", "12", "--ignore-eos", "--num-blocks", "64", "--threads", "1"]
ARGS = [*GREEDY, "--max-num-seqs", "1"]  # one request at a time: results arrive one by one
_WORDS = "paged attention keeps the cache in fixed size blocks and reuses every cached prefix".split()


@pytest.fixture(autouse=True, scope="module")
def keep_torch_threads():
    """Engines here run on one thread (a tiny model: more threads only contend); put the setting back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def write_prompts(path: Path) -> None:
    rng = random.Random(8)
    path.write_text("".join(f"{i}: {' '.join(rng.choices(_WORDS, k=rng.randint(2, 12)))}\n"
                            for i in range(NUM_PROMPTS)))


def complete_records(path: Path) -> list[dict]:
    """The whole lines of an output file (a killed run may leave a partial last line, dropped on resume)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


def assert_ordered_prefix(records: list[dict]) -> None:
    assert [r["line"] for r in records] == list(range(1, len(records) + 1)), "in order, no gaps, no duplicates"
    assert all("text" in r and r["completion_tokens"] == 12 for r in records)


def start(model: Path, src: Path, dst: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagecli", "generate", str(src), "-o", str(dst), "-m", str(model),
                             *ARGS], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ)


def wait_for_lines(proc: subprocess.Popen, dst: Path, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(complete_records(dst)) < count:
        assert proc.poll() is None, f"the run ended before writing {count} lines: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.002)


def without_cache_counts(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "cached_tokens"} for r in records]  # depends on batch history


def test_sigkill_at_random_points_then_rerun_gives_every_line_once_in_order(tiny_llama, tmp_path):
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    write_prompts(src)
    # The reference batches every request at once: greedy output does not depend on the batch.
    assert main(["generate", str(src), "-o", str(tmp_path / "reference.jsonl"), "-m", str(tiny_llama), *GREEDY]) == 0
    reference = complete_records(tmp_path / "reference.jsonl")
    rng = random.Random(2024)

    proc = start(tiny_llama, src, dst)  # killed while it loads the model
    time.sleep(rng.uniform(0.2, 1.0))
    proc.kill()
    proc.wait()
    for _ in range(2):  # killed while results are being written
        done = len(complete_records(dst))
        proc = start(tiny_llama, src, dst)
        wait_for_lines(proc, dst, done + rng.randint(1, 8))
        proc.kill()
        proc.wait()
        assert_ordered_prefix(complete_records(dst))
    assert 0 < len(complete_records(dst)) < NUM_PROMPTS, "the kills were meant to land mid-run"

    proc = start(tiny_llama, src, dst)  # Ctrl-C: a clean stop that says how far it got
    done = len(complete_records(dst))
    wait_for_lines(proc, dst, done + 1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    written = len(complete_records(dst)) - done
    assert f"Interrupted: {written} of {NUM_PROMPTS - done} results written; run the same command again" in stderr
    assert "Traceback" not in stderr
    assert dst.read_bytes().endswith(b"\n"), "a clean stop leaves no partial line"

    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *ARGS]) == 0
    final = complete_records(dst)
    assert_ordered_prefix(final)
    assert len(final) == NUM_PROMPTS and dst.read_bytes().count(b"\n") == NUM_PROMPTS
    assert without_cache_counts(final) == without_cache_counts(reference)


def test_ctrl_c_right_after_a_result_is_written_counts_it(tiny_llama, tmp_path, monkeypatch, capsys):
    """SIGINT lands while the third result is being written: the summary counts exactly what the file holds."""
    from pagecli.cli.batch_io import ResultWriter

    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    write_prompts(src)
    original_write = ResultWriter.write

    def write_then_ctrl_c(self, record):
        original_write(self, record)
        if record["line"] == 3:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ResultWriter, "write", write_then_ctrl_c)
    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *ARGS]) == 130
    err = capsys.readouterr().err
    assert len(complete_records(dst)) == 3
    assert f"Interrupted: 3 of {NUM_PROMPTS} results written" in err
