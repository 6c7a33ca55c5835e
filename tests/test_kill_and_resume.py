"""`pagecli generate` killed at random points and run again until done loses and duplicates nothing,
and two runs on one output never both write it.

Each run is a real process: SIGKILL while the model loads and while results are being written,
SIGINT for a clean stop with a summary, then a last run that completes. After every run the file
holds whole JSON lines, in input order, each line once; results that finished ahead of their turn
wait in the journal (OUTPUT.pagecli-journal) and survive the kill; at the end, exactly the records of a run
that was never interrupted. The output's lock dies with its process.
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
    records = [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]
    return [r for r in records if "line" in r]  # a journal begins with pagecli's header line


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
    assert f"Interrupted: {written} of {NUM_PROMPTS - done} results saved; run the same command again" in stderr
    assert "Traceback" not in stderr
    assert dst.read_bytes().endswith(b"\n"), "a clean stop leaves no partial line"

    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *ARGS]) == 0
    final = complete_records(dst)
    assert_ordered_prefix(final)
    assert len(final) == NUM_PROMPTS and dst.read_bytes().count(b"\n") == NUM_PROMPTS
    assert without_cache_counts(final) == without_cache_counts(reference)


def test_ctrl_c_right_after_a_result_is_written_counts_it(tiny_llama, tmp_path, monkeypatch, capsys):
    """SIGINT lands while the third result is being written: the summary counts exactly what the file holds."""
    from pagecli.batch.results_writer import ResultWriter

    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    write_prompts(src)
    original_save = ResultWriter.save

    def save_then_ctrl_c(self, record):
        original_save(self, record)
        if record["line"] == 3:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ResultWriter, "save", save_then_ctrl_c)
    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *ARGS]) == 130
    err = capsys.readouterr().err
    assert len(complete_records(dst)) == 3
    assert f"Interrupted: 3 of {NUM_PROMPTS} results saved" in err


# --- results that finish out of order ----------------------------------------------------------------------
def write_uneven_requests(path: Path, count: int) -> None:
    """Every other request is long: with several running at once, short ones finish ahead of their turn."""
    path.write_text("".join(json.dumps({"prompt": f"{i}: paged attention", "max_tokens": 120 if i % 2 else 3}) + "\n"
                            for i in range(count)))


def test_sigkill_keeps_results_that_finished_ahead_of_their_turn(tiny_llama, tmp_path):
    src, dst, journal = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "out.jsonl.pagecli-journal"
    write_uneven_requests(src, 24)
    uneven = ["-t", "0", "--ignore-eos", "--num-blocks", "128", "--threads", "1", "--max-num-seqs", "4"]
    assert main(["generate", str(src), "-o", str(tmp_path / "reference.jsonl"), "-m", str(tiny_llama), *uneven]) == 0
    reference = complete_records(tmp_path / "reference.jsonl")

    proc = subprocess.Popen([sys.executable, "-m", "pagecli", "generate", str(src), "-o", str(dst),
                             "-m", str(tiny_llama), *uneven], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(complete_records(journal)) < 3:
        assert proc.poll() is None, f"the run ended before its journal held 3 results: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    in_order, ahead = complete_records(dst), complete_records(journal)
    assert_ordered_prefix_of(in_order, reference)
    assert {r["line"] for r in ahead} - {r["line"] for r in in_order}, "the journal held results the output lacked"
    saved = {r["line"] for r in in_order} | {r["line"] for r in ahead}

    rerun = subprocess.run([sys.executable, "-m", "pagecli", "generate", str(src), "-o", str(dst),
                            "-m", str(tiny_llama), *uneven], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"Resuming: {len(saved)} of 24 requests already done" in rerun.stderr
    assert without_cache_counts(complete_records(dst)) == without_cache_counts(reference)
    assert not journal.exists()


def assert_ordered_prefix_of(records: list[dict], reference: list[dict]) -> None:
    assert without_cache_counts(records) == without_cache_counts(reference[: len(records)])


# --- one run at a time per output ---------------------------------------------------------------------------
HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from pagecli.batch.side_files import OutputLock
with OutputLock(Path(sys.argv[1]), sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def hold_the_lock(dst: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(dst)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_on_a_locked_output_names_the_holder_and_leaves_the_file_alone(tiny_llama, tmp_path, capsys):
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    write_prompts(src)
    cut_off = b'{"id": "line-1", "line": 1, "text": "x", "finish_reason": "stop"}\n{"id": "line-2", "li'
    dst.write_bytes(cut_off)  # the holder may be writing this line right now: it must not be cut
    holder = hold_the_lock(dst)
    try:
        assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *ARGS]) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"Another pagecli run is writing '{dst}' (process {holder.pid})" in err
    assert "Loading model" not in err and dst.read_bytes() == cut_off


def test_a_lock_left_by_a_killed_run_does_not_block_the_next(tiny_llama, tmp_path):
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    write_prompts(src)
    holder = hold_the_lock(dst)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / "out.jsonl.pagecli-lock").exists()
    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *GREEDY]) == 0
    assert_ordered_prefix(complete_records(dst))
    assert len(complete_records(dst)) == NUM_PROMPTS


def test_two_runs_started_at_once_write_every_record_once(tiny_llama, tmp_path):
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("".join(f"prompt number {i}\n" for i in range(24)))
    runs = [subprocess.Popen([sys.executable, "-m", "pagecli", "generate", str(src), "-o", str(dst),
                              "-m", str(tiny_llama), *ARGS], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    results = [(run.wait(timeout=300), run.stderr.read()) for run in runs]
    for code, err in results:
        assert code == 0 or (code == 2 and "Another pagecli run is writing" in err), err
    assert [r["line"] for r in complete_records(dst)] == list(range(1, 25))
    assert dst.read_bytes().count(b"\n") == 24
