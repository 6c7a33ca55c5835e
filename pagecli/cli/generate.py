"""`pagecli generate`: batch file-to-file generation with continuous batching and resume."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from pagecli.chat.turn import StopFlag
from pagecli.cli.batch_io import BadLine, BatchRequest, ResultWriter, detect_format, parse_requests, read_input
from pagecli.cli.options import RunSettings
from pagecli.config import SamplingParams
from pagecli.errors import PagecliError
from pagecli.ui.progress import GenerateProgress, load_summary, say

_NUMERIC = {"max_tokens": int, "top_k": int, "seed": int, "temperature": float, "top_p": float, "min_p": float,
            "repetition_penalty": float}


def line_sampling(base: SamplingParams, overrides: dict[str, Any], line: int) -> SamplingParams:
    """The run's sampling settings with one input line's fields on top; a bad value names the line."""
    values = asdict(base)
    for key, value in overrides.items():
        kind = _NUMERIC.get(key)
        if kind is not None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or (kind is int and isinstance(value, float) and not value.is_integer()):
                raise PagecliError(f"line {line}: '{key}' must be {'an integer' if kind is int else 'a number'}")
            value = kind(value)
        elif key == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
                raise PagecliError(f"line {line}: 'stop' must be a string or a list of non-empty strings")
            value = tuple(value)
        values[key] = value
    try:
        return SamplingParams(**values)
    except PagecliError as exc:
        raise PagecliError(f"line {line}: {exc}") from None


def run_generate(settings: RunSettings, input_path: str, output_path: str, fmt: str,
                 progress: bool | None) -> int:
    lines = read_input(input_path)
    items = list(parse_requests(lines, detect_format(input_path, lines, fmt)))
    writer = ResultWriter(output_path)
    try:
        return _generate(settings, items, writer, input_path, output_path, progress)
    finally:
        writer.close()


def _generate(settings: RunSettings, items: list[BatchRequest | BadLine], writer: ResultWriter,
              input_path: str, output_path: str, progress: bool | None) -> int:
    todo = [it for it in items if it.line not in writer.done_lines]
    if not todo:
        say(f"Nothing to do: all {len(items)} requests in '{input_path}' already have results in '{output_path}'.")
        return 0
    if writer.done_lines:
        say(f"Resuming: {len(items) - len(todo)} of {len(items)} requests already done in '{output_path}'.")
    from pagecli.engine import Engine

    say("Loading model ...", style="dim")
    engine = Engine(settings.model, settings.engine, progress=lambda msg: say(msg, style="dim"))
    say(load_summary(engine.stats()), style="dim")
    try:
        return _drive(engine, settings, todo, writer, progress)
    finally:
        engine.close()  # waits for pending disk-store writes
        for warning in engine.take_warnings():
            say(f"Warning: {warning}", style="yellow")


def _drive(engine: Any, settings: RunSettings, todo: list[BatchRequest | BadLine], writer: ResultWriter,
           progress: bool | None) -> int:
    order = [it.line for it in todo]
    ids = {it.line: it.request_id for it in todo}
    ready: dict[int, dict[str, Any]] = {}
    next_index = 0
    errors = 0

    def flush() -> None:
        nonlocal next_index
        while next_index < len(order) and order[next_index] in ready:
            writer.write(ready.pop(order[next_index]))
            next_index += 1

    for it in todo:
        if isinstance(it, BadLine):
            ready[it.line] = {"id": it.request_id, "line": it.line, "error": it.error}
            errors += 1
            continue
        try:
            engine.add_request(it.prompt, line_sampling(settings.sampling, it.sampling, it.line), str(it.line))
        except PagecliError as exc:
            message = str(exc) if str(exc).startswith("line ") else f"line {it.line}: {exc}"
            ready[it.line] = {"id": it.request_id, "line": it.line, "error": message}
            errors += 1
    flush()
    texts: dict[int, list[str]] = {}
    start = time.perf_counter()
    tokens = 0
    done = len(ready) + next_index
    # Ctrl-C only sets the flag, checked between results, so the count below is what the file holds;
    # a second Ctrl-C raises KeyboardInterrupt at once.
    stop = StopFlag()
    try:
        with stop.catching_sigint(), GenerateProgress(len(todo), progress) as bar:
            for ev in engine.stream():
                line = int(ev.request_id)
                texts.setdefault(line, []).append(ev.text)
                tokens += len(ev.token_ids)
                if ev.finished:
                    ready[line] = {
                        "id": ids[line], "line": line, "text": "".join(texts.pop(line)),
                        "finish_reason": ev.finish_reason, "prompt_tokens": ev.prompt_tokens,
                        "completion_tokens": ev.completion_tokens, "cached_tokens": ev.cached_tokens,
                    }
                    done += 1
                    flush()
                    bar.update(done, tokens / max(time.perf_counter() - start, 1e-9), engine.stats())
                if stop():
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        say(f"Interrupted: {next_index} of {len(order)} results written; run the same command again to resume.",
            style="yellow")
        return 130
    _summary(engine, len(order), errors, tokens, time.perf_counter() - start)
    return 1 if errors and errors == len(order) else 0


def _summary(engine: Any, total: int, errors: int, tokens: int, elapsed_s: float) -> None:
    stats = engine.stats()
    say(
        f"Done: {total - errors} completions, {errors} errors; {tokens} tokens in {elapsed_s:.1f} s "
        f"({tokens / max(elapsed_s, 1e-9):.1f} tok/s); prefix cache served {stats.prefix_hit_rate:.0%} of prompt "
        f"tokens ({stats.prefix_disk_hit_tokens / max(stats.prefix_query_tokens, 1):.0%} from disk); "
        f"{stats.num_preemptions} preemptions."
    )
