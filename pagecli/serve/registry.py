"""The registry of keep-alive servers: each `pagecli serve --keep-alive` writes one small JSON file under
paths.servers_dir() (where it listens, its pid, the model it runs and with which engine and sampling settings,
whether it wants an API key) and removes it on exit. `pagecli chat` and `pagecli generate` read it to use a running
server of the same model instead of loading one.

Invariants: a file appears whole (written beside, then renamed) and only once the server listens with its
model loaded; an entry whose process is gone, or whose address refuses connections, is stale and removed
by whoever reads it; the key itself is never written, only its SHA-256, so a client knows whether the key
it holds opens the server. Standard library only: reading the registry must not slow a command's start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagecli.paths import make_private_dir, servers_dir

REGISTRY_VERSION = 1
HEALTH_TIMEOUT_S = 0.5
_SUFFIX = ".json"


@dataclass(frozen=True)
class ServerEntry:
    """One running keep-alive server, as its registry file records it."""

    pid: int
    host: str
    port: int
    model: str  # the model as the server's user named it ("" for the embedded default)
    model_identity: str  # source.model_identity of that name
    engine_digest: str  # engine_digest of the server's engine settings
    api_key_sha256: str | None  # None: the server takes requests without a key
    keep_alive_s: float
    started: float  # seconds since the epoch
    sampling: dict[str, Any]  # sampling_defaults of the server's settings: what a request that leaves them out gets

    @property
    def url(self) -> str:
        """The address a client on this machine uses (a server listening on every interface answers on loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def opens_with(self, api_key: str | None) -> bool:
        """Whether a client holding `api_key` (or none) may use this server."""
        return self.api_key_sha256 is None or (api_key is not None and key_digest(api_key) == self.api_key_sha256)

    def to_dict(self) -> dict[str, Any]:
        return {"version": REGISTRY_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerEntry:
        if data.get("version") != REGISTRY_VERSION:
            raise ValueError(f"registry version {data.get('version')!r}")
        names = {field.name for field in dataclasses.fields(cls)}
        entry = cls(**{name: data[name] for name in names})
        if not (isinstance(entry.pid, int) and isinstance(entry.port, int) and isinstance(entry.host, str)):
            raise ValueError("pid, port or host of the wrong type")
        return entry


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def engine_digest(engine: Any) -> str:
    """A digest of engine settings (an EngineConfig): a client and a server with equal digests were given the
    same engine settings, so the server runs what the client would have loaded."""
    fields = dataclasses.asdict(engine)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sampling_defaults(sampling: Any) -> dict[str, Any]:
    """The sampling settings (a SamplingParams) a request may leave out and then gets from the server's profile
    and flags, in JSON's terms. (temperature, top_p and max_tokens are always sent; n, beams and a schema
    are refused by `pagecli serve` as run-wide settings.)"""
    return {"top_k": sampling.top_k, "min_p": sampling.min_p, "repetition_penalty": sampling.repetition_penalty,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            "seed": sampling.seed, "stop": list(sampling.stop), "ignore_eos": sampling.ignore_eos,
            "logit_bias": [[token, float(bias)] for token, bias in sampling.logit_bias]}


def samples_alike(entry: ServerEntry, sampling: Any, sent: set[str]) -> bool:
    """Whether requests with these settings (of which the fields in `sent` travel with each request) sample on the
    server as they would here: every setting left out is the server's own."""
    own = sampling_defaults(sampling)
    return all(entry.sampling.get(key) == value for key, value in own.items() if key not in sent)


def register(entry: ServerEntry, folder: Path | None = None) -> Path:
    """Write the entry's file (readable by this user only) and return its path; remove it with unregister."""
    folder = folder or servers_dir()
    make_private_dir(folder)
    path = folder / f"{entry.pid}-{entry.port}{_SUFFIX}"
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)  # mode 0600
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(entry.to_dict(), out)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def unregister(path: Path) -> None:
    path.unlink(missing_ok=True)


def recorded(folder: Path | None = None) -> list[tuple[Path, ServerEntry]]:
    """Every entry written, live or not; unreadable files are removed (a file is written whole, so such a
    file is not a server's)."""
    folder = folder or servers_dir()
    try:
        paths = sorted(p for p in folder.iterdir() if p.suffix == _SUFFIX and not p.name.startswith("."))
    except OSError:
        return []
    found = []
    for path in paths:
        try:
            found.append((path, ServerEntry.from_dict(json.loads(path.read_text(encoding="utf-8")))))
        except FileNotFoundError:
            continue  # its server removed it meanwhile
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)
    return found


def live_servers(folder: Path | None = None, timeout_s: float = HEALTH_TIMEOUT_S) -> list[ServerEntry]:
    """The recorded servers that run and answer /health; stale entries are removed on the way. A server too
    busy to answer within timeout_s is left out but kept."""
    live = []
    for path, entry in recorded(folder):
        state = _health(entry, timeout_s) if _pid_alive(entry.pid) else "gone"
        if state == "ok":
            live.append(entry)
        elif state == "gone":
            unregister(path)
    return live


def find_server(model_identity: str, engine: str, api_key: str | None, folder: Path | None = None,
                sampling: Any = None, sent: set[str] = frozenset()) -> ServerEntry | None:
    """A live server of this model identity and engine digest that `api_key` opens (and, given `sampling`, whose
    defaults fill in what the requests leave out as these settings would: samples_alike); the newest if several."""
    candidates = [entry for entry in live_servers(folder) if entry.model_identity == model_identity
                  and entry.engine_digest == engine and entry.opens_with(api_key)
                  and (sampling is None or samples_alike(entry, sampling, sent))]
    return max(candidates, key=lambda entry: entry.started, default=None)


def any_recorded(folder: Path | None = None) -> bool:
    """Whether the registry holds any file: the one check a command makes when no server runs."""
    folder = folder or servers_dir()
    try:
        return any(p.suffix == _SUFFIX and not p.name.startswith(".") for p in folder.iterdir())
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if sys.platform == "win32":
        return True  # os.kill(pid, 0) would end the process there: /health alone tells
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process holds the pid: ours is gone, /health will tell
    except OSError:
        return False
    return True


def _health(entry: ServerEntry, timeout_s: float) -> str:
    """"ok", "busy" (no answer in time, or shutting down) or "gone" (refused, or not a pagecli server)."""
    try:
        with urllib.request.urlopen(entry.url + "/health", timeout=timeout_s) as response:  # noqa: S310
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return "busy" if exc.code == 503 else "gone"
    except (TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return "busy" if isinstance(reason, TimeoutError) or "timed out" in str(reason) else "gone"
    except ValueError:
        return "gone"
    return "ok" if isinstance(body, dict) and body.get("status") == "ok" else "gone"
