"""Whether `pagecli chat` or `pagecli generate` without --server should use a running keep-alive server
(`pagecli serve --keep-alive`, found in the registry, pagecli/serve/registry.py) instead of loading the model.

A server is used only when it runs the same model (source.model_identity: the same folder and files, or the
same .gguf file) with the same engine settings, its sampling defaults fill in what the requests leave out as this
command's settings would (registry.samples_alike), and the client's API key (if the server wants one) opens it;
else the command loads the model itself, as it always did. Nothing is started here. Standard library and
torch-free modules only: with no server recorded this costs one directory listing.
"""

from __future__ import annotations

from pagecli.config import RunSettings
from pagecli.errors import PagecliError
from pagecli.serve import registry
from pagecli.ui.progress import say


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
