"""The one exception type for mistakes a user can make; the CLI prints its message as one red line."""

from __future__ import annotations


class PagecliError(Exception):
    """A failure the user can cause and fix; the message says what to do."""

    exit_code = 2


class ModelError(PagecliError):
    """The model could not be found, read or run."""

    exit_code = 3


class RequestError(PagecliError):
    """One request cannot be run (bad fields, a chat template that rejects it, an over-long prompt);
    every other request goes on. The message says what is wrong with this request alone."""


def request_failure(exc: BaseException) -> str | None:
    """What a per-request failure says, or None when `exc` is not one (a bug: let it propagate).

    The one place that decides this: `generate` writes it as the line's error record, `chat` prints it
    and goes on, and the server answers it as a 400.
    """
    if isinstance(exc, PagecliError):
        return str(exc)
    if type(exc).__module__.startswith("jinja2"):  # a chat template's raise_exception() or a template bug
        return f"the chat template rejected this conversation: {exc}"
    if isinstance(exc, (RecursionError, UnicodeError)):
        return f"the request could not be read ({type(exc).__name__}: {exc})"
    return None


def request_error_of(exc: BaseException, what_failed: str,
                     also: tuple[type[BaseException], ...] = ()) -> RequestError | None:
    """`exc` as this request's RequestError, or None for a bug. Besides what `request_failure` knows,
    the exception types in `also` count as the request's fault here, said as `what_failed` (the
    tokenizer's TypeError on a lone surrogate, a template's own TypeError on some conversations)."""
    message = request_failure(exc)
    if message is None and isinstance(exc, also):
        message = f"{what_failed} ({type(exc).__name__}: {exc})"
    return None if message is None else RequestError(message)
