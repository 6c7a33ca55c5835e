"""The one exception type for mistakes a user can make; the CLI prints its message as one red line."""

from __future__ import annotations


class PagecliError(Exception):
    """A failure the user can cause and fix; the message says what to do."""

    exit_code = 2


class ModelError(PagecliError):
    """The model could not be found, read or run."""

    exit_code = 3
