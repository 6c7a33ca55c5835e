"""LoRA adapters in GGUF files, as llama.cpp's convert_lora_to_gguf.py writes them, turned into the PEFT folder
they stand for (in pagecli's cache, once per file content); models/lora.py then checks and loads that folder.

Such a file has general.type "adapter", adapter.type "lora" and adapter.lora.alpha, and per layer and target
`blk.N.<name>.weight.lora_a` [r, in] and `.lora_b` [out, r] (GGUF lists dimensions innermost first). llama.cpp
scales each pair by alpha / r, as PEFT does without rsLoRA. For llama-family models the q and k products' B rows
are in llama.cpp's rotary order, as the base's q/k weights are in its GGUF files: restored to Hugging Face's.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from pagecli import paths
from pagecli.errors import ModelError
from pagecli.models.gguf_convert import PERMUTED_ROTARY_ARCHITECTURES
from pagecli.models.spec import DecoderSpec

# GGUF tensor name -> (submodule, PEFT target) of the decoders pagecli runs (not Phi-3's fused products).
_TARGETS = {"attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"), "attn_v": ("self_attn", "v_proj"),
            "attn_output": ("self_attn", "o_proj"), "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"),
            "ffn_down": ("mlp", "down_proj")}
_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


def is_gguf_adapter(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def peft_folder_for(name: str, path: Path, spec: DecoderSpec) -> Path:
    """The PEFT folder (adapter_config.json, adapter_model.safetensors) of a GGUF LoRA file, written to the
    cache on first use; ModelError, one sentence, for a file that is not a LoRA adapter of this model."""
    # The heads restore q/k's row order: a file read for a base of other heads is another folder.
    digest = _file_hash(path, f"{spec.model_type}/{spec.num_heads}/{spec.num_kv_heads}")
    folder = paths.models_dir() / "lora-gguf" / digest
    if (folder / "adapter_model.safetensors").is_file():
        return folder
    alpha, pairs = _read(name, path, spec)
    staging = folder.with_name(f"{digest}.partial")
    staging.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    tensors = {f"base_model.model.model.layers.{layer}.{sub}.{target}.lora_{side.upper()}.weight": weight
               for (layer, sub, target), sides in pairs.items() for side, weight in sides.items()}
    save_file(tensors, str(staging / "adapter_model.safetensors"))
    ranks = {sides["a"].shape[0] for sides in pairs.values()}
    config = {"peft_type": "LORA", "r": max(ranks), "lora_alpha": alpha, "use_rslora": False, "bias": "none",
              "target_modules": sorted({target for _, _, target in pairs}),
              "rank_pattern": {}, "alpha_pattern": {}, "source_gguf": str(path)}
    (staging / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not folder.exists():  # else another process wrote the same folder first
        staging.replace(folder)
    return folder


def _read(name: str, path: Path, spec: DecoderSpec) -> tuple[float, dict[tuple[int, str, str], dict[str, np.ndarray]]]:
    """alpha, and each (layer, submodule, target)'s {"a": [r, in], "b": [out, r]} float32 in PEFT's layout."""
    from gguf import GGUFReader, dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the gguf package raises several kinds for a file it cannot read
        raise ModelError(f"LoRA adapter '{name}': {path} is not a readable GGUF file ({exc}).") from None
    fields = {key: _field_text(field) for key, field in reader.fields.items() if not key.startswith("tokenizer.")}
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise ModelError(f"LoRA adapter '{name}': {path} is not a GGUF LoRA adapter (general.type "
                         f"{fields.get('general.type')!r}); give one written by llama.cpp's convert_lora_to_gguf.py.")
    architecture = fields.get("general.architecture")
    if architecture != spec.model_type:
        raise ModelError(f"LoRA adapter '{name}': {path} is an adapter of a '{architecture}' model; the base model "
                         f"is '{spec.model_type}'.")
    alpha = float(fields.get("adapter.lora.alpha", 0.0))
    pairs: dict[tuple[int, str, str], dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        match = _TENSOR.fullmatch(tensor.name)
        if match is None or match.group(2) not in _TARGETS:
            raise ModelError(f"LoRA adapter '{name}': {path} has a tensor '{tensor.name}' that pagecli does not "
                             "apply (it applies LoRA pairs of the attention and MLP products).")
        layer, (sub, target), side = int(match.group(1)), _TARGETS[match.group(2)], match.group(3)
        weight = dequantize(tensor.data, tensor.tensor_type)
        weight = np.ascontiguousarray(weight, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        if side == "b" and architecture in PERMUTED_ROTARY_ARCHITECTURES and target in ("q_proj", "k_proj"):
            from pagecli.models.gguf_convert import unpermute_rotary_rows

            heads = spec.num_heads if target == "q_proj" else spec.num_kv_heads
            weight = np.ascontiguousarray(unpermute_rotary_rows(weight, heads))
        pairs.setdefault((layer, sub, target), {})[side] = weight
    if not pairs:
        raise ModelError(f"LoRA adapter '{name}': {path} holds no LoRA tensors.")
    if not alpha:  # convert_lora_to_gguf.py always writes it; without it llama.cpp scales by 1
        alpha = float(next(iter(pairs.values()))["a"].shape[0])
    return alpha, pairs


def _field_text(field) -> str | float | None:
    from gguf import GGUFValueType

    if not field.types or not field.data or field.types[0] == GGUFValueType.ARRAY:
        return None
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return float(value[0])


def describe(name: str, path: Path) -> str:
    """`pagecli models --lora`'s line for a GGUF LoRA file (no base model to check it against)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {key: _field_text(field) for key, field in reader.fields.items() if not key.startswith("tokenizer.")}
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise ModelError(f"LoRA adapter '{name}': {path} is not a GGUF LoRA adapter; give one written by llama.cpp's "
                         "convert_lora_to_gguf.py.")
    matches = [m for m in map(_TENSOR.fullmatch, (t.name for t in reader.tensors)) if m is not None]
    ranks = sorted({int(t.shape[1]) for t in reader.tensors if t.name.endswith(".lora_a")})
    targets = sorted({_TARGETS.get(m.group(2), ("", m.group(2)))[1] for m in matches})
    layers = {m.group(1) for m in matches}
    return (f"{name}  GGUF LoRA of a {fields.get('general.architecture')} model, rank "
            f"{'/'.join(map(str, ranks))}, alpha {fields.get('adapter.lora.alpha')} (alpha/r), {len(layers)} layers, "
            f"{', '.join(targets)}; {path.stat().st_size / 1e6:,.1f} MB  {path}")


def _file_hash(path: Path, salt: str) -> str:
    h = hashlib.blake2b(salt.encode(), digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
