"""Where `bench` writes its reports (--json, --plot): a path is written only when it holds nothing, or a
report pagecli wrote before (a JSON document whose `schema` names pagecli, a PNG carrying pagecli's
`Software` text), unless the user says --force. Checked before the workload runs.
"""

from __future__ import annotations

import json
import os
import stat

from pagecli.errors import PagecliError

PNG_SOFTWARE = "pagecli bench"  # the PNG text chunk plot.py writes, and the mark of a plot pagecli made
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_READ_LIMIT_BYTES = 64 << 20  # a report is small; a larger file is not one


def check_report_path(path: str | None, kind: str, force: bool) -> None:
    """PagecliError when `path` holds a file that is not a pagecli `kind` report ("json" or "plot") and
    `force` is off; a path to create, an empty file, '-' (stdout) or a device may be written."""
    if not path or path == "-" or force:
        return
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise PagecliError(f"Cannot use '{path}' for the {kind} report: {exc.strerror or exc}.") from None
    if stat.S_ISDIR(info.st_mode):
        raise PagecliError(f"'{path}' is a directory; give a file path for the {kind} report.")
    if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
        return
    if info.st_size > _READ_LIMIT_BYTES or not _is_our_report(path, kind):
        flag = "--json" if kind == "json" else "--plot"
        raise PagecliError(f"'{path}' holds something that is not a pagecli {kind} report, and pagecli does not "
                           f"overwrite it; choose another {flag} path, or pass --force to replace it.")


def _is_our_report(path: str, kind: str) -> bool:
    try:
        with open(path, "rb") as f:
            data = f.read(_READ_LIMIT_BYTES)
    except OSError:
        return False
    if kind == "plot":
        return data.startswith(_PNG_SIGNATURE) and f"Software\0{PNG_SOFTWARE}".encode() in data
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(document, dict) and str(document.get("schema", "")).startswith("pagecli.bench.")
