"""`pagecli generate`: batch file-to-file generation with continuous batching and resume.

The batch library (pagecli/batch) does the work: the input is read by requests.py; the output is
checked by results_file.py before anything is written, and written by results_writer.py (locked,
journaled, in input order); submit.py queues each line, a line that cannot run becoming its error
record. This module chooses between a local run and Ray workers and drives the local one.
"""

from __future__ import annotations

import time
from typing import Any

from pagecli.chat.turn import StopFlag
from pagecli.batch.input_lines import DEFAULT_MAX_LINE_BYTES
from pagecli.batch.line_results import LineResults
from pagecli.batch.requests import BadLine, BatchRequest, input_name, read_requests, sampling_with
from pagecli.batch.results_file import RunIdentity, plan_resume, scan_output, settings_digest
from pagecli.batch.results_writer import ResultWriter, open_results
from pagecli.batch.submit import submit_line
from pagecli.config import RunSettings
from pagecli.errors import PagecliError
from pagecli.serve.registry import ServerEntry
from pagecli.ui.progress import GenerateProgress, adapter_text, load_summary, say

def run_generate(settings: RunSettings, input_path: str, output_path: str, fmt: str,
                 progress: bool | None, retry_errors: bool = False, cluster: Any = None,
                 force_restart: bool = False, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                 server: tuple[str, str | None] | None = None, found: ServerEntry | None = None,
                 found_key: str | None = None) -> int:
    """Runs every input line without a result in the output (with `retry_errors`, also those whose result
    is an error; with `force_restart`, every line, the output emptied first); the exit code: 0, 1 when every
    line run failed, 130 when interrupted. With `cluster` (pagecli.cluster.launch.ClusterOptions) the lines run
    on Ray workers; reading and writing are the same. An output that answers another input or other settings
    is refused (results_file.check_answers). `found` is a keep-alive server of the same model (cli/running_server.py),
    used unless a line needs the model here (tools) or it no longer answers."""
    if force_restart and retry_errors:
        raise PagecliError("--force-restart runs every line again; leave out --retry-errors.")
    items = read_requests(input_path, fmt, max_line_bytes)
    identity = run_identity(items, input_path, settings)
    # Checked before the lock is taken, so a finished output in a read-only folder needs no lock file.
    if not force_restart:
        plan = plan_resume(scan_output(output_path, input_path), identity, retry_errors)
        if plan.settled and not plan.todo:
            _say_unchecked(plan.unchecked, input_path, output_path)
            say(_nothing_to_do(len(items), input_path, output_path, retry_errors))
            return 0
    with open_results(output_path, input_path, identity, retry_errors, force_restart) as writer:
        _say_unchecked(writer.plan.unchecked, input_path, output_path)
        todo = [it for it in items if it.line in writer.plan.todo]
        if not todo:  # every result was saved; a killed run left them to be put in order
            writer.finish()
            say(_nothing_to_do(len(items), input_path, output_path, retry_errors))
            return 0
        if writer.plan.kept:
            say(f"Resuming: {writer.plan.kept} of {len(items)} requests already done in '{output_path}'.")
        if cluster is not None:
            from pagecli.cluster.driver import run_on_cluster

            return run_on_cluster(settings, todo, writer, progress, cluster)
        if server is None and found is not None:
            server = _use_found(found, found_key, todo)
        if server is not None:
            return _generate_on_server(settings, todo, writer, progress, *server)
        return _generate(settings, todo, writer, progress)


def _use_found(found: ServerEntry, api_key: str | None, todo: list[BatchRequest | BadLine]) -> tuple[str, str | None] | None:
    """(url, key) of the keep-alive server found, or None to run here: a line with tools needs the model in this
    process, and a server that stopped meanwhile is said in a dim line."""
    from pagecli.batch.remote import ServerConnection
    from pagecli.cli.running_server import announce, fall_back

    if any(isinstance(item, BatchRequest) and item.tools is not None for item in todo):
        return None
    try:
        ServerConnection(found.url, api_key).model()
    except PagecliError as error:
        fall_back(found, error)
        return None
    announce(found)
    return found.url, api_key


def run_identity(items: list[BatchRequest | BadLine], input_path: str, settings: RunSettings) -> RunIdentity:
    """What this run's records answer: each line's digest and id, and the sampling settings' digest."""
    return RunIdentity(input_name(input_path), {it.line: it.line_sha256 for it in items},
                       {it.line: it.request_id for it in items}, settings_digest(settings.sampling))


def _say_unchecked(count: int, input_path: str, output_path: str) -> None:
    if count:
        say(f"Note: {count} results in '{output_path}' were written by an older pagecli that did not record "
            f"their input; they are kept because their ids match {input_name(input_path)}. Pass --force-restart "
            "if they came from another input or other settings.", style="yellow")


def _nothing_to_do(count: int, input_path: str, output_path: str, retry_errors: bool) -> str:
    none_failed = ", none of them an error" if retry_errors else ""
    return (f"Nothing to do: all {count} requests in {input_name(input_path)} already have results in "
            f"'{output_path}'{none_failed}.")


def _generate(settings: RunSettings, todo: list[BatchRequest | BadLine], writer: ResultWriter,
              progress: bool | None) -> int:
    from pagecli.engine import Engine

    say("Loading model ...", style="dim")
    config = settings.engine.for_one_stream() if _one_stream(settings, todo) else settings.engine
    engine = Engine(settings.model, config, progress=lambda msg: say(msg, style="dim"))
    say(load_summary(engine.stats()), style="dim")
    try:
        return _drive(engine, settings, todo, writer, progress)
    finally:
        engine.close()  # waits for pending disk-store writes
        for warning in engine.take_warnings():
            say(f"Warning: {warning}", style="yellow")


def _one_stream(settings: RunSettings, todo: list[BatchRequest | BadLine]) -> bool:
    """Whether the run decodes one sequence at a time: one line to run, one candidate, no beams."""
    requests = [item for item in todo if isinstance(item, BatchRequest)]
    if len(requests) != 1:
        return False
    try:
        sampling = sampling_with(settings.sampling, requests[0].sampling)
    except PagecliError:
        return False  # the line's own settings are refused when it is submitted
    return sampling.num_sequences == 1 and not sampling.beam_search


def _generate_on_server(settings: RunSettings, todo: list[BatchRequest | BadLine], writer: ResultWriter,
                        progress: bool | None, url: str, api_key: str | None) -> int:
    """The lines answered by a running `pagecli serve` (pagecli/batch/remote.py), written as a local run writes."""
    from pagecli.batch.remote import ServerConnection, run_on_server

    connection = ServerConnection(url, api_key)
    start, tokens = time.perf_counter(), 0
    with GenerateProgress(len(todo), progress) as bar:
        def on_record(record: dict[str, Any]) -> None:
            nonlocal tokens
            tokens += record.get("completion_tokens", 0)
            bar.update(writer.saved, tokens / max(time.perf_counter() - start, 1e-9), None)

        try:
            errors = run_on_server(connection, settings.sampling, todo, writer.save, on_record)
        except KeyboardInterrupt:
            say(f"Interrupted: {writer.saved} of {len(todo)} results saved; run the same command again to resume.",
                style="yellow")
            return 130
    writer.finish()
    elapsed_s = time.perf_counter() - start
    say(f"Done: {len(todo) - errors} completions, {errors} errors; {tokens} tokens in {elapsed_s:.1f} s "
        f"({tokens / max(elapsed_s, 1e-9):.1f} tok/s) from {connection.url}.")
    return 1 if errors == len(todo) else 0


def _drive(engine: Any, settings: RunSettings, todo: list[BatchRequest | BadLine], writer: ResultWriter,
           progress: bool | None) -> int:
    results = LineResults()
    errors = sum(not submit_line(engine, settings, it, writer, results) for it in todo)
    start = time.perf_counter()
    tokens = 0
    # Ctrl-C only sets the flag, checked between results, so the count below is what the files hold;
    # a second Ctrl-C raises KeyboardInterrupt at once.
    stop = StopFlag()
    try:
        with stop.catching_sigint(), GenerateProgress(len(todo), progress) as bar:
            for ev in engine.stream():
                tokens += len(ev.token_ids)
                record = results.add(int(ev.request_id), ev)
                if record is not None:
                    writer.save(record)
                    bar.update(writer.saved, tokens / max(time.perf_counter() - start, 1e-9), engine.stats())
                if stop():
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        say(f"Interrupted: {writer.saved} of {len(todo)} results saved; run the same command again to resume.",
            style="yellow")
        return 130
    writer.finish()
    _summary(engine, len(todo), errors, tokens, time.perf_counter() - start)
    return 1 if errors == len(todo) else 0


def _summary(engine: Any, total: int, errors: int, tokens: int, elapsed_s: float) -> None:
    stats = engine.stats()
    say(
        f"Done: {total - errors} completions, {errors} errors; {tokens} tokens in {elapsed_s:.1f} s "
        f"({tokens / max(elapsed_s, 1e-9):.1f} tok/s); prefix cache served {stats.prefix_hit_rate:.0%} of prompt "
        f"tokens ({stats.prefix_disk_hit_tokens / max(stats.prefix_query_tokens, 1):.0%} from disk); "
        f"{stats.num_preemptions} preemptions{_sharing(stats)}{_speculation(stats)}{_adapters(stats)}."
    )


def _speculation(stats: Any) -> str:
    """How speculative decoding went (--speculate); nothing when no drafts were checked."""
    if not stats.spec_passes:
        return ""
    method = f" ({stats.spec_method})" if stats.spec_method else ""
    return (f"; speculation{method} accepted {stats.spec_acceptance:.0%} of {stats.spec_drafts} drafts, "
            f"{stats.spec_tokens / stats.spec_passes:.2f} tokens per checking pass")


def _adapters(stats: Any) -> str:
    """Requests and cached blocks per LoRA adapter; nothing when no line named one."""
    text = adapter_text(stats)
    return f"; LoRA adapters: {text}" if text else ""


def _sharing(stats: Any) -> str:
    """What forked candidates (n > 1) saved by sharing blocks; nothing when no line forked."""
    if not stats.fork_block_shares:
        return ""
    return (f"; candidates shared {stats.fork_block_shares} prompt blocks, copied {stats.cow_block_copies} "
            f"on write: {stats.blocks_saved_by_sharing} blocks saved")
