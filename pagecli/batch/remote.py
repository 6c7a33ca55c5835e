"""A batch run whose lines a running `pagecli serve` answers (`pagecli generate --server URL`), and the HTTP
connection `pagecli chat --server` shares: only the standard library speaks HTTP here.

Each line goes to the server as its own request (chat messages to /v1/chat/completions, a plain prompt to
/v1/completions), several at once so the server batches them; the line's own sampling fields travel as it
wrote them, the run's settings under them. A line the server refuses gets its error record, as a line the
local engine refuses does; records are written by the same results writer, so resume works the same.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagecli.batch.requests import BadLine, BatchRequest
from pagecli.config.settings import SamplingParams
from pagecli.errors import PagecliError, RequestError

TIMEOUT_S = 600.0  # a whole non-streamed reply may take long on a busy server
CONCURRENT = 16  # requests in flight: enough for the server to batch, few enough to stay polite


class ServerConnection:
    """GET and POST JSON to a running `pagecli serve`; its refusals are RequestError (the request's fault),
    not reaching it a PagecliError."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key

    def open(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 30.0) -> Any:
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=timeout_s)  # noqa: S310 - the URL the user gave
        except urllib.error.HTTPError as exc:
            message = f"{self.url}{path} answered {exc.code}: {_error_message(exc)}"
            raise (RequestError(message) if 400 <= exc.code < 500 and exc.code != 401 else PagecliError(message)) \
                from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PagecliError(f"Cannot reach the pagecli server at {self.url} ({reason}); is `pagecli serve` "
                               "running there?") from None

    def get(self, path: str) -> Any:
        with self.open(path) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict[str, Any], timeout_s: float = TIMEOUT_S) -> Any:
        with self.open(path, body, timeout_s) as response:
            return json.loads(response.read())

    def model(self) -> str:
        try:
            return self.get("/v1/models")["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise PagecliError(f"{self.url} answered /v1/models without a model; is it a pagecli server?") from None


def api_fields(sampling: SamplingParams) -> dict[str, Any]:
    """The OpenAI-API fields of these settings (pagecli's server also takes top_k, min_p and
    repetition_penalty). A run-wide structured constraint is refused: send response_format per line."""
    if sampling.structured is not None:
        raise PagecliError("--json-schema needs the model in this process; with --server, put response_format "
                           "on the lines (or in the request).")
    fields: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                              "max_tokens": sampling.max_tokens}
    optional = {"top_k": sampling.top_k, "min_p": sampling.min_p, "presence_penalty": sampling.presence_penalty,
                "frequency_penalty": sampling.frequency_penalty, "seed": sampling.seed,
                "stop": list(sampling.stop) or None, "n": sampling.n if sampling.n > 1 else None,
                "repetition_penalty": None if sampling.repetition_penalty == 1.0 else sampling.repetition_penalty,
                "logit_bias": {str(t): b for t, b in sampling.logit_bias} or None}
    fields.update({key: value for key, value in optional.items() if value})
    return fields


def line_record(item: BatchRequest, answer: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The line's record from the server's reply, in the fields a local run writes (line_results.py)."""
    usage = answer.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    choices = sorted(answer.get("choices") or (), key=lambda choice: choice.get("index", 0))

    def text_of(choice: dict[str, Any]) -> str:
        return (choice.get("message") or {}).get("content") or "" if chat else choice.get("text") or ""

    counts = {"prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0),
              "cached_tokens": cached}
    if len(choices) == 1:
        return {"id": item.request_id, "line": item.line, "text": text_of(choices[0]),
                "finish_reason": choices[0].get("finish_reason"), **counts}
    return {"id": item.request_id, "line": item.line, "choices": [
        {"index": i, "text": text_of(choice), "finish_reason": choice.get("finish_reason")}
        for i, choice in enumerate(choices)], **counts}


def run_on_server(connection: ServerConnection, sampling: SamplingParams, todo: list[BatchRequest | BadLine],
                  save: Callable[[dict[str, Any]], None], on_record: Callable[[dict[str, Any]], None]) -> int:
    """Every line of `todo` answered by the server, each record saved as it comes; returns the error count."""
    model, base = connection.model(), api_fields(sampling)
    errors = 0

    def answer(item: BatchRequest) -> dict[str, Any]:
        chat = not isinstance(item.prompt, str)
        if item.tools is not None:
            raise RequestError("a line with tools needs the model in this process; run it without --server")
        prompt = item.prompt
        if chat:
            messages = prompt.messages if hasattr(prompt, "messages") else prompt
            body = {"model": model, "messages": messages, **base, **item.sampling}
        else:
            body = {"model": model, "prompt": prompt, **base, **item.sampling}
        return line_record(item, connection.post("/v1/chat/completions" if chat else "/v1/completions", body), chat)

    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        futures = []
        for item in todo:
            if isinstance(item, BadLine):
                save({"id": item.request_id, "line": item.line, "error": item.error})
                errors += 1
            else:
                futures.append((item, pool.submit(answer, item)))
        for item, future in futures:
            try:
                record = future.result()
            except RequestError as exc:
                save({"id": item.request_id, "line": item.line, "error": f"line {item.line}: {exc}"})
                errors += 1
                continue
            save(record)
            on_record(record)
    return errors


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        payload = json.loads(exc.read())
        error = payload.get("error", payload)
        return str(error.get("message", error) if isinstance(error, dict) else error)
    except (ValueError, OSError, AttributeError):
        return str(exc.reason or "an error")
