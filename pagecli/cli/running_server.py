"""Whether `pagecli chat` or `pagecli generate` without --server should use a running keep-alive server
(`pagecli serve --keep-alive`, found in the registry, pagecli/serve/registry.py) instead of loading the model.

A server is used only when it runs the same model (source.model_identity: the same folder and files, or the
same .gguf file) with the same engine settings, its sampling defaults fill in what the requests leave out as this
command's settings would (registry.samples_alike), and the client's API key (if the server wants one) opens it;
else the command loads the model itself, as it always did. Nothing is started unless the user asks with
`--keep-alive DURATION` (start_keep_alive_server): then, where no such server runs, this command starts
`pagecli serve --keep-alive DURATION` with its own model, profile and flags in the background and uses it, and the
next command of the same model finds it. Standard library and torch-free modules only: with no server recorded
this costs one directory listing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pagecli.config import RunSettings
from pagecli.errors import PagecliError
from pagecli.paths import make_private_dir, servers_dir
from pagecli.serve import registry
from pagecli.ui.progress import say

STARTED_LOG = "started.log"  # the output of the servers --keep-alive started, in servers_dir()
_LOG_LIMIT = 1 << 20  # emptied before a start once past this
_POLL_S = 0.1
_MISMATCH_POLLS = 30  # polls a registered server may fail to match (a busy one may miss a /health) before it goes


def running_server_for(settings: RunSettings, api_key: str | None) -> registry.ServerEntry | None:
    """The live keep-alive server that runs what `settings` would load here, or None."""
    if settings.sampling.structured is not None or settings.sampling.beam_search:
        return None  # a run-wide schema and beam search need the model in this process
    if not registry.any_recorded():
        return None
    from pagecli.models.source import model_identity

    from pagecli.batch.remote import api_fields

    try:
        identity = model_identity(settings.model)
    except (PagecliError, OSError):
        return None  # the local run says what is wrong with MODEL
    return registry.find_server(identity, registry.engine_digest(settings.engine), api_key,
                                sampling=settings.sampling, sent=set(api_fields(settings.sampling)))


def announce(entry: registry.ServerEntry) -> None:
    say(f"using the running pagecli serve at {entry.url} (keep-alive); --local to run in this process", style="dim")


def fall_back(entry: registry.ServerEntry, error: Exception) -> None:
    say(f"the pagecli serve at {entry.url} stopped answering ({error}); running in this process", style="dim")


def running_or_started(settings: RunSettings, server_args: list[str], keep_alive: str | None,
                       api_key: str | None) -> registry.ServerEntry | None:
    """The live keep-alive server for `settings`; else, with --keep-alive, one started for it; else None."""
    found = running_server_for(settings, api_key)
    if found is None and keep_alive is not None:
        found = start_keep_alive_server(settings, server_args, keep_alive, api_key)
    return found


def start_keep_alive_server(settings: RunSettings, server_args: list[str], keep_alive: str,
                            api_key: str | None) -> registry.ServerEntry | None:
    """Start `pagecli serve --keep-alive KEEP_ALIVE` with server_args (this command's model, profile and flags:
    RunFlags.as_args) in a session of its own, so it outlives this command; wait until it is registered with its
    model loaded, and return its entry. None (said) where a server cannot run these settings' requests."""
    from pagecli.serve.keep_alive import parse_duration

    parse_duration(keep_alive)  # a bad duration is one sentence before anything starts
    if settings.sampling.structured is not None or settings.sampling.beam_search:
        say("--keep-alive: a run-wide --json-schema or beam search runs in this process; no server started.",
            style="dim")
        return None
    make_private_dir(servers_dir())
    log_path = servers_dir() / STARTED_LOG
    if log_path.is_file() and log_path.stat().st_size > _LOG_LIMIT:
        log_path.unlink()
    command = [sys.executable, "-m", "pagecli", "serve", "--port", "0", "--no-screen", "--keep-alive", keep_alive,
               *server_args]
    say(f"Starting `pagecli serve --keep-alive {keep_alive}` in the background (its output: {log_path}); the next "
        "chat or generate of this model uses it ...", style="dim")
    with open(log_path, "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
        log.flush()
        env = {**os.environ, "COLUMNS": "200"}
        if api_key is not None:
            env["PAGECLI_API_KEY"] = api_key  # the server wants the key this command holds
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=env)
    mismatches = 0
    try:
        while True:
            entry = running_server_for(settings, api_key)
            if entry is not None and entry.pid == process.pid:
                return entry
            # up, but not found for these settings (or too busy to answer); registered just now: matched next poll
            listed = any(listed.pid == process.pid for _, listed in registry.recorded())
            mismatches = mismatches + 1 if listed else 0
            if mismatches >= _MISMATCH_POLLS:
                raise PagecliError("The keep-alive server started does not run this command's settings (some "
                                   "setting did not pass to it); stopped it. Run without --keep-alive, or start "
                                   "`pagecli serve --keep-alive` with the settings you want.")
            if process.poll() is not None:
                raise PagecliError(f"The keep-alive server stopped before it was ready (exit code "
                                   f"{process.returncode}): {_last_line(log_path)} (its output: {log_path}).")
            time.sleep(_POLL_S)
    except BaseException:
        if process.poll() is None:  # interrupted while it loads: it was never used, so it goes
            process.terminate()
        raise


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
