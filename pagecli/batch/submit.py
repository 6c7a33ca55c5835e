"""Queueing one input line on an engine, the same way for a local run (`pagecli generate`) and a Ray worker
(pagecli/cluster/worker.py): a line that cannot run, whatever raised, becomes that line's error record."""

from __future__ import annotations

from typing import Any

from pagecli.batch.line_results import LineResults
from pagecli.batch.line_tools import record_fields
from pagecli.batch.requests import BadLine, BatchRequest, sampling_with
from pagecli.config import RunSettings, SamplingParams
from pagecli.errors import PagecliError, request_failure


def line_sampling(base: SamplingParams, overrides: dict[str, Any], line: int) -> SamplingParams:
    """The run's sampling settings with one input line's fields on top; a bad value names the line."""
    try:
        return sampling_with(base, overrides)
    except PagecliError as exc:
        raise PagecliError(f"line {line}: {exc}") from None


def submit_line(engine: Any, settings: RunSettings, item: BatchRequest | BadLine, writer: Any,
                results: LineResults) -> bool:
    """Queues one line; a line that cannot run gets its error record at once (`writer.save`). True when
    queued."""
    if isinstance(item, BadLine):
        writer.save({"id": item.request_id, "line": item.line, "error": item.error})
        return False
    try:
        sampling = line_sampling(settings.sampling, item.sampling, item.line)
        engine.add_request(item.prompt, sampling, str(item.line))
        results.expect(item.line, item.request_id, sampling.n,
                       record_fields(item.tools, getattr(engine, "chat_template", None)))
    except Exception as exc:  # noqa: BLE001 - request_failure sorts the line's fault from a bug
        message = request_failure(exc)
        if message is None:
            raise
        prefix = "" if message.startswith(f"line {item.line}: ") else f"line {item.line}: "
        writer.save({"id": item.request_id, "line": item.line, "error": prefix + message})
        return False
    return True
