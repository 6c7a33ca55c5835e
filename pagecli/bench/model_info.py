"""The KV geometry of a named model, read from its config alone: no weights are loaded or converted.

KV bytes per token = layers x KV heads x head dim x 2 (K and V) x dtype bytes, the same figure
the engine sizes its blocks with (DecoderSpec.kv_bytes_per_token).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagecli.errors import ModelError

DEFAULT_MODEL_ALIASES = ("default",)


@dataclass(frozen=True)
class ModelKV:
    name: str
    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int
    context_len: int  # the engine's default max_model_len for this model

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    def kv_bytes_per_token_as(self, kv_dtype: str) -> int:
        """KV bytes per token with the cache in `kv_dtype` (--kv-dtype: int8/fp8 add a 2-byte scale per row)."""
        import torch

        from pagecli.kv_format import resolve_kv_format

        fmt = resolve_kv_format(kv_dtype, getattr(torch, self.dtype), self.head_dim)
        return fmt.bytes_per_token(self.num_layers, self.num_kv_heads)


def model_kv(model: str, dtype: str = "auto", device: str = "auto") -> ModelKV:
    """KV geometry of MODEL ('default', a folder, a .gguf file or a hub id) in the dtype the engine would use."""
    from pagecli.config.settings import DEFAULT_CONTEXT_CAP
    from pagecli.models.loader import resolve_device, resolve_dtype
    from pagecli.models.source import DEFAULT_MODEL_NAME
    from pagecli.models.spec import DecoderSpec

    hf_config, source = _hf_config(model)
    spec = DecoderSpec.from_hf_config(hf_config, source)
    torch_dtype = resolve_dtype(dtype, hf_config, resolve_device(device))
    context = min(spec.max_position_embeddings, DEFAULT_CONTEXT_CAP)
    if spec.sliding_window:
        context = min(context, spec.sliding_window)
    return ModelKV(
        name=f"{DEFAULT_MODEL_NAME} (embedded)" if model in DEFAULT_MODEL_ALIASES else model,
        model_type=spec.model_type, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, dtype=str(torch_dtype).removeprefix("torch."), dtype_bytes=torch_dtype.itemsize,
        context_len=context,
    )


@dataclass(frozen=True)
class AdapterMemory:
    """One LoRA adapter's bytes over a model, as the engine would hold it."""

    name: str
    rank: int
    nbytes: int  # its pairs in the model's dtype (what the start-up line counts per adapter)


def adapter_memory(model: str, pairs: tuple[tuple[str, str], ...], dtype: str = "auto",
                   device: str = "auto") -> tuple[AdapterMemory, ...]:
    """Each adapter's bytes over MODEL in the dtype the engine would use, from the adapter's config and
    safetensors header (checked against the model's shapes); no weights are read."""
    from pagecli.models.loader import resolve_device, resolve_dtype
    from pagecli.models.lora import adapter_bytes, inspect_adapter
    from pagecli.models.spec import DecoderSpec

    hf_config, source = _hf_config(model)
    spec = DecoderSpec.from_hf_config(hf_config, source)
    torch_dtype = resolve_dtype(dtype, hf_config, resolve_device(device))
    infos = [inspect_adapter(name, path, spec, None) for name, path in pairs]  # a report: any rank is counted
    return tuple(AdapterMemory(info.name, info.rank, adapter_bytes(info, spec, torch_dtype)) for info in infos)


def _hf_config(model: str) -> tuple[Any, str]:
    """The model's config and where it was read (named in errors about its fields)."""
    from pagecli.models import source
    from pagecli.models.loader import load_hf_config

    path = Path(model).expanduser()
    if path.is_dir():
        return load_hf_config(path), str(path / "config.json")
    if model in DEFAULT_MODEL_ALIASES:
        gguf = source.default_model_gguf()
        return _gguf_config(gguf), str(gguf)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_config(path), str(path)
    if source.looks_like_hub_id(model):
        return _hub_config(model), model
    raise ModelError(
        f"Model '{model}' is neither a folder, a .gguf file, a hub id nor 'default'; "
        "or leave out --model and give --kv-bytes-per-token."
    )


def _gguf_config(gguf_path: Path) -> Any:
    """The config of a converted copy when there is one, else the one the converter would write."""
    from pagecli.models import gguf_convert, source
    from pagecli.models.loader import load_hf_config

    converted = source.converted_folder_for(gguf_path)
    if (converted / source.CONVERTED_MARKER).is_file():
        return load_hf_config(converted)
    config = gguf_convert.read_gguf_config(gguf_path)
    return SimpleNamespace(**{"model_type": "llama", **config})  # what DecoderSpec reads; no transformers import


def _hub_config(repo_id: str) -> Any:
    from transformers import AutoConfig

    from pagecli.models.source import hub_offline

    try:
        return AutoConfig.from_pretrained(repo_id, local_files_only=hub_offline(), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        where = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if hub_offline() else "the Hugging Face Hub"
        raise ModelError(f"Cannot read the config of '{repo_id}' from {where}; pass a local model folder.") from exc
