"""`pagecli generate --ray` on a local Ray cluster (2 CPUs, no dashboard, started once for the module) with
two one-thread workers on a tiny model: the output is the single-process run's, line for line; a worker
killed mid-run (for good, or restarted by Ray), or one whose call raises, loses and duplicates nothing; a
driver killed with SIGKILL then run again gives every line once, in order; Ctrl-C stops a run cleanly."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from pagecli.cli import main  # noqa: E402
from pagecli.cluster.driver import ClusterRun  # noqa: E402
from pagecli.cluster.worker import EngineWorker  # noqa: E402

NUM_PROMPTS = 24
GREEDY = ["-t", "0", "-n", "10", "--ignore-eos", "--num-blocks", "64", "--max-num-seqs", "2"]
RAY = ["--ray", "--workers", "2", "--threads-per-worker", "1"]
_WORDS = "paged attention keeps the cache in fixed size blocks and reuses every cached prefix".split()

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray instance for the module (starting Ray takes seconds); the CLI uses the open session."""
    threads = torch.get_num_threads()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    torch.set_num_threads(threads)


def write_input(path: Path) -> None:
    """Prompts of a few sizes (two share a long head, so routing keys matter), a bad JSON line and a
    line whose sampling field is wrong: both must become the same error records as without Ray."""
    lines = []
    for i in range(NUM_PROMPTS):
        words = " ".join(_WORDS[(i * 5 + k) % len(_WORDS)] for k in range(3 + i % 9))
        head = "shared head: " + " ".join(_WORDS) * 2 if i % 6 == 0 else ""
        lines.append(json.dumps({"prompt": f"{head}{i}: {words}"}))
    lines.insert(5, "{not json")
    lines.insert(9, json.dumps({"prompt": "x", "temperature": "hot"}))
    path.write_text("\n".join(lines) + "\n")


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "cached_tokens"} for r in rows]  # depends on batch history


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    src, dst = folder / "in.jsonl", folder / "out.jsonl"
    write_input(src)
    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *GREEDY, "--threads", "1"]) == 1 - 1
    rows = records(dst)
    assert len(rows) == NUM_PROMPTS + 2 and sum("error" in r for r in rows) == 2
    return src, rows


def test_ray_output_equals_the_single_process_run_line_for_line(ray_address, tiny_llama, reference, tmp_path,
                                                                 capsys):
    src, expected = reference
    dst = tmp_path / "out.jsonl"
    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *GREEDY, *RAY]) == 0
    assert comparable(records(dst)) == comparable(expected)
    err = capsys.readouterr().err
    assert "on 2 Ray workers" in err and "w0:" in err and "w1:" in err
    counts = [int(err.split(f"{w}: ")[1].split(" requests")[0]) for w in ("w0", "w1")]
    assert all(counts) and sum(counts) == NUM_PROMPTS + 1, f"both ran lines (the bad JSON line ran nowhere): {counts}"
    assert not (tmp_path / "out.jsonl.partial").exists()


@pytest.mark.parametrize("restart", [False, True], ids=["killed-for-good", "restarted-by-ray"])
def test_a_worker_killed_mid_run_loses_and_duplicates_nothing(ray_address, tiny_llama, reference, tmp_path,
                                                               monkeypatch, capsys, restart):
    src, expected = reference
    dst = tmp_path / "out.jsonl"
    original = ClusterRun._receive
    killed = []

    def receive_then_kill(self, worker, ref):
        original(self, worker, ref)
        if not killed and self.writer.saved >= 6 and self.pending:
            killed.append(self.workers[0].name)
            ray.kill(self.workers[0].handle, no_restart=not restart)

    monkeypatch.setattr(ClusterRun, "_receive", receive_then_kill)
    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *GREEDY, *RAY]) == 0
    assert killed == ["w0"]
    rows = records(dst)
    assert [r["line"] for r in rows] == sorted({r["line"] for r in rows}), "in order, each line once"
    assert dst.read_bytes().count(b"\n") == NUM_PROMPTS + 2
    assert comparable(rows) == comparable(expected)
    err = capsys.readouterr().err
    assert "died holding" in err, err
    assert ("w0 (lost)" in err) is not restart, err


def start_driver(model: Path, src: Path, dst: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pagecli", "generate", str(src), "-o", str(dst), "-m", str(model), *GREEDY,
         "--max-num-seqs", "1", *RAY, "--ray-address", address],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ)


def wait_for_lines(proc: subprocess.Popen, dst: Path, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(records(dst)) < count:
        assert proc.poll() is None, f"the run ended before writing {count} lines: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.005)


def test_sigkill_of_the_driver_then_a_rerun_gives_every_line_once(ray_address, tiny_llama, reference, tmp_path):
    src, expected = reference
    dst = tmp_path / "out.jsonl"
    proc = start_driver(tiny_llama, src, dst, ray_address)
    wait_for_lines(proc, dst, 4)
    proc.kill()
    proc.wait()
    first = records(dst)
    assert [r["line"] for r in first] == list(range(1, len(first) + 1))
    assert len(first) < NUM_PROMPTS + 2, "the kill was meant to land mid-run"

    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *GREEDY, *RAY]) == 0
    final = records(dst)
    assert dst.read_bytes().count(b"\n") == NUM_PROMPTS + 2
    assert comparable(final) == comparable(expected)


def test_ctrl_c_stops_the_driver_cleanly_and_keeps_what_it_wrote(ray_address, tiny_llama, reference, tmp_path):
    # Long replies (400 tokens a line, one sequence per worker) leave the run seconds of work after its first
    # line, so the interrupt lands mid-run; it is sent once a line is out (the drive loop handles SIGINT by then).
    src, _ = reference
    dst = tmp_path / "out.jsonl"
    long_replies = ["-t", "0", "-n", "400", "--ignore-eos", "--num-blocks", "64", "--max-num-seqs", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagecli", "generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *long_replies,
         *RAY, "--ray-address", ray_address], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=os.environ)
    wait_for_lines(proc, dst, 1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Interrupted:" in stderr and "run the same command again" in stderr and "Traceback" not in stderr
    assert dst.read_bytes().endswith(b"\n")
    written = records(dst)
    assert [r["line"] for r in written] == list(range(1, len(written) + 1))
    assert len(written) < NUM_PROMPTS + 2, "the interrupt was meant to land mid-run"


def test_more_workers_than_the_cluster_holds_is_one_sentence(ray_address, tiny_llama, reference, tmp_path, capsys):
    src, _ = reference
    argv = ["generate", str(src), "-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_llama), *GREEDY, "--ray",
            "--workers", "3", "--threads-per-worker", "1"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "3 workers of 1 CPU each do not fit the Ray cluster (2 CPUs" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists() or not records(tmp_path / "out.jsonl")


def test_an_input_of_only_bad_lines_needs_no_worker(tiny_llama, tmp_path, monkeypatch):
    import pagecli.cluster.launch as launch

    monkeypatch.setattr(launch, "start_workers", lambda *a, **k: pytest.fail("no worker was needed"))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": 3}\n{oops\n')
    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *RAY]) == 1
    assert [("error" in r, r["line"]) for r in records(dst)] == [(True, 1), (True, 2)]


class FailsOnce(EngineWorker):
    """A worker whose third call raises, once in the whole run (a marker file says it has): as an engine that
    runs out of memory would."""

    calls = 0

    def advance(self, items, min_s, max_s):
        self.calls += 1
        if self.calls == 3:
            try:
                os.close(os.open(os.environ["PAGECLI_TEST_FAIL_MARK"], os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                raise RuntimeError("injected failure")
        return super().advance(items, min_s, max_s)


def test_a_worker_whose_call_raises_is_restarted_and_its_lines_run_again(ray_address, tiny_llama, reference,
                                                                          tmp_path, monkeypatch, capsys):
    import pagecli.cluster.launch as launch

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    monkeypatch.setattr(launch, "EngineWorker", FailsOnce)
    monkeypatch.setenv("PAGECLI_TEST_FAIL_MARK", str(tmp_path / "failed"))
    src, expected = reference
    dst = tmp_path / "out.jsonl"
    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *GREEDY, "--max-num-seqs", "1",
                 *RAY]) == 0
    assert (tmp_path / "failed").exists(), "the failure was injected"
    assert dst.read_bytes().count(b"\n") == NUM_PROMPTS + 2
    assert comparable(records(dst)) == comparable(expected)
    err = capsys.readouterr().err
    assert "failed (RuntimeError: injected failure); restarting it" in err, err
