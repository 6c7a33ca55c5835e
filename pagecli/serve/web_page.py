"""The web page at /: one HTML file from the package (web/index.html) with its styles and script inline,
no external fonts, scripts or styles, so it works offline. It chats through /v1/chat/completions and draws
the pool from /v1/pool."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from starlette.responses import HTMLResponse

# The page runs only its own inline script and talks only to this server.
_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                       "connect-src 'self'; img-src 'self' data:",
            "Cache-Control": "no-cache"}


@cache
def page_html() -> str:
    return files("pagecli.serve").joinpath("web/index.html").read_text(encoding="utf-8")


def response() -> HTMLResponse:
    return HTMLResponse(page_html(), headers=_HEADERS)
