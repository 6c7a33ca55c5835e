"""LoRA adapters from PEFT folders: checked against the base model, then held as one low-rank pair per layer
and product of the decoder (models/lora_batch.py adds them to a step's rows).

A PEFT folder holds adapter_config.json (r, lora_alpha, use_rslora, rank_pattern, alpha_pattern) and
adapter_model.safetensors (`...layers.N.self_attn.q_proj.lora_A.weight` [r, in], `lora_B.weight` [out, r]).
Each target's output is W x + scaling * B A x, scaling = alpha / r (rsLoRA: alpha / sqrt(r)). The decoder
runs q/k/v as one qkv_proj and gate/up as one gate_up_proj, so the pairs of one fused product are stacked:
A's rows one target after another [sum r, in], B with each target's rows at that target's output rows and
zero elsewhere [out, sum r], the scaling folded into B.

A GGUF LoRA file (llama.cpp's) is first written out as the PEFT folder it stands for (models/lora_gguf.py).
`inspect_adapter` reads only the config and the safetensors header, so a mismatched adapter is one clear
ModelError at start-up without loading its weights; `load_adapter` loads them (on first use).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagecli.errors import ModelError
from pagecli.models import lora_gguf
from pagecli.models.spec import DecoderSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The decoder's products, and the checkpoint targets each one runs (in output-row order).
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
PRODUCTS = tuple(FUSED_TARGETS)  # also the CPU kernels' order of a layer's products (lora_slots, LoraStacks)
ATTENTION_PRODUCTS = ("qkv_proj", "o_proj")  # in self_attn; the others in mlp
_PRODUCT_OF = {target: product for product, targets in FUSED_TARGETS.items() for target in targets}
_PRODUCT_OF.update({"qkv_proj": "qkv_proj", "gate_up_proj": "gate_up_proj"})  # Phi-3's checkpoint names
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight")


@dataclass(frozen=True)
class LowRank:
    """One fused product's low-rank pair: the product's rows gain (x @ a.T) @ b.T."""

    a: torch.Tensor  # [sum of the targets' ranks, in_features]
    b: torch.Tensor  # [out_features, sum of the targets' ranks], scaling folded in


@dataclass(frozen=True)
class AdapterInfo:
    """What start-up checks of an adapter: enough to validate it and count its bytes, no weights."""

    name: str
    folder: Path
    rank: int  # the largest target rank
    targets: tuple[str, ...]  # checkpoint module names, sorted (q_proj, v_proj, ...)
    content_hash: str  # of the config and weights files: the prefix cache's chains of this adapter root in it
    num_params: int
    scalings: dict[str, float]  # "N.target" -> alpha / r (or alpha / sqrt(r))
    ranks: dict[str, int]  # "N.target" -> r


@dataclass(frozen=True, eq=False)  # compared by identity: one loaded adapter is one object
class LoraAdapter:
    info: AdapterInfo
    layers: tuple[dict[str, LowRank], ...]  # per decoder layer: product name (qkv_proj, ...) -> its pair

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
                   for layer in self.layers for p in layer.values())


def _target_shapes(spec: DecoderSpec) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every checkpoint target the decoder has."""
    q, kv, hidden, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, \
        spec.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
            "qkv_proj": (q + 2 * kv, hidden), "gate_up_proj": (2 * inter, hidden)}


def _checkpoint_targets(spec: DecoderSpec) -> tuple[str, ...]:
    """The module names an adapter of this model may target: the checkpoint's (fused in Phi-3's)."""
    if spec.fused_checkpoint:
        return PRODUCTS
    if spec.num_experts:  # a mixture of experts: adapters of the attention only (not of the experts)
        return ("q_proj", "k_proj", "v_proj", "o_proj")
    return ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _read_config(folder: Path, name: str) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise ModelError(f"LoRA adapter '{name}': {folder} is not a folder; give a PEFT adapter folder "
                         f"(with {CONFIG_FILE} and {WEIGHTS_FILE}) or a GGUF LoRA file (.gguf).")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"LoRA adapter '{name}': {folder} has no {CONFIG_FILE}; give a PEFT adapter folder.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"LoRA adapter '{name}': {path} could not be read as JSON ({exc}).") from None
    if not isinstance(config, dict):
        raise ModelError(f"LoRA adapter '{name}': {path} is not a JSON object.")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ModelError(f"LoRA adapter '{name}': its peft_type is {kind}; only LORA adapters are supported.")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (fully trained extra layers)"),
                     ("fan_in_fan_out", "fan_in_fan_out (Conv1D layouts)")):
        if config.get(key):
            raise ModelError(f"LoRA adapter '{name}' uses {why}, which pagecli does not support.")
    if config.get("bias", "none") not in ("none", None):
        raise ModelError(f"LoRA adapter '{name}' trains biases (bias={config['bias']!r}); pagecli supports bias \"none\".")
    return config


def _pattern_value(patterns: dict[str, Any], module: str, default: float) -> float:
    """PEFT's rank_pattern/alpha_pattern: a key matches a module name ending in it (as a regex)."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return float(value)
    return default


def _content_hash(folder: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        with (folder / file).open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _tensor_shapes(path: Path, name: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    if not path.is_file():
        raise ModelError(f"LoRA adapter '{name}': {path.parent} has no {WEIGHTS_FILE}.")
    try:
        with safe_open(str(path), "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own and OS errors: the file is unreadable
        raise ModelError(f"LoRA adapter '{name}': {path} is not a readable safetensors file ({exc}).") from None


def inspect_adapter(name: str, folder: str | Path, spec: DecoderSpec, max_rank: int | None) -> AdapterInfo:
    """Check a PEFT adapter folder against the base model (layers, targets, shapes, rank) from its config and
    its safetensors header; ModelError, one sentence, on the first mismatch. max_rank None: any rank (a
    report that loads nothing)."""
    folder = Path(folder).expanduser()
    if lora_gguf.is_gguf_adapter(folder):  # llama.cpp's file: checked as the PEFT folder it stands for
        folder = lora_gguf.peft_folder_for(name, folder, spec)
    config = _read_config(folder, name)
    shapes = _tensor_shapes(folder / WEIGHTS_FILE, name)
    expected = _target_shapes(spec)
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ModelError(f"LoRA adapter '{name}': tensor '{key}' is not a LoRA pair of a decoder layer's "
                             "attention or MLP product, which is all pagecli applies.")
        layer, target, side = int(match.group(1)), match.group(3), match.group(4)
        known = _checkpoint_targets(spec)
        if target not in known:
            raise ModelError(f"LoRA adapter '{name}' targets '{target}', which this model does not have; its "
                             f"targets are {', '.join(known)}.")
        if layer >= spec.num_layers:
            raise ModelError(f"LoRA adapter '{name}' has layer {layer}; the base model has {spec.num_layers} layers "
                             "(is the adapter for another model?).")
        pairs.setdefault((layer, target), {})[side] = shape
    if not pairs:
        raise ModelError(f"LoRA adapter '{name}': {WEIGHTS_FILE} holds no LoRA tensors.")
    rank, scalings, ranks, num_params = 0, {}, {}, 0
    alpha = float(config.get("lora_alpha", 8))  # the tensors' own ranks count (rank_pattern included)
    for (layer, target), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise ModelError(f"LoRA adapter '{name}': layer {layer} {target} has lora_{next(iter(sides))} "
                             "without its other half.")
        out_features, in_features = expected[target]
        a, b = sides["A"], sides["B"]
        if len(a) != 2 or len(b) != 2 or a[1] != in_features or b[0] != out_features or a[0] != b[1]:
            raise ModelError(f"LoRA adapter '{name}': layer {layer} {target} has A {list(a)} and B {list(b)}; this "
                             f"model needs A [r, {in_features}] and B [{out_features}, r] (is the adapter for "
                             "another model?).")
        r = a[0]
        if max_rank is not None and r > max_rank:
            raise ModelError(f"LoRA adapter '{name}' has rank {r} (layer {layer} {target}); the limit is "
                             f"{max_rank}: raise --max-lora-rank or use an adapter of a lower rank.")
        module = f"model.layers.{layer}.{_submodule(target)}.{target}"
        module_alpha = _pattern_value(config.get("alpha_pattern"), module, alpha)
        ranks[f"{layer}.{target}"] = r
        scalings[f"{layer}.{target}"] = module_alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        rank, num_params = max(rank, r), num_params + r * (in_features + out_features)
    return AdapterInfo(name, folder, rank, tuple(sorted({t for _, t in pairs})), _content_hash(folder),
                       num_params, scalings, ranks)


def describe_folder(name: str, folder: str | Path) -> str:
    """One line on a PEFT adapter folder without a base model to check it against (`pagecli models --lora`):
    its ranks, targets, scaling and size on disk; ModelError for a folder that is not one."""
    folder = Path(folder).expanduser()
    if lora_gguf.is_gguf_adapter(folder):
        return lora_gguf.describe(name, folder)
    config = _read_config(folder, name)
    shapes = _tensor_shapes(folder / WEIGHTS_FILE, name)
    targets, ranks, layers = set(), set(), set()
    for key, shape in shapes.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ModelError(f"LoRA adapter '{name}': tensor '{key}' is not a LoRA pair of a decoder layer's "
                             "attention or MLP product, which is all pagecli applies.")
        layers.add(int(match.group(1)))
        targets.add(match.group(3))
        if match.group(4) == "A":
            ranks.add(shape[0])
    rank_text = "/".join(str(r) for r in sorted(ranks))
    scaling = "rsLoRA alpha/sqrt(r)" if config.get("use_rslora") else "alpha/r"
    size_mb = (folder / WEIGHTS_FILE).stat().st_size / 1e6
    return (f"{name}  rank {rank_text}, alpha {config.get('lora_alpha', 8)} ({scaling}), {len(layers)} layers, "
            f"{', '.join(sorted(targets))}; {size_mb:,.1f} MB  {folder}")


def _submodule(target: str) -> str:
    """The submodule a target lives in: self_attn or mlp."""
    return "self_attn" if _PRODUCT_OF[target] in ATTENTION_PRODUCTS else "mlp"


def load_adapter(info: AdapterInfo, spec: DecoderSpec, dtype: torch.dtype, device: torch.device) -> LoraAdapter:
    """The adapter's pairs, stacked per fused product, in the model's dtype on its device."""
    from safetensors.torch import load_file

    raw = load_file(str(info.folder / WEIGHTS_FILE))
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        match = _KEY.fullmatch(key)
        assert match is not None, "inspect_adapter checked every key"
        found.setdefault((int(match.group(1)), match.group(3)), {})[match.group(4)] = tensor.float()
    out_rows = _target_shapes(spec)
    layers: list[dict[str, LowRank]] = []
    for layer in range(spec.num_layers):
        products: dict[str, LowRank] = {}
        for product, targets in FUSED_TARGETS.items():
            names = (product,) if spec.fused_checkpoint and product in ("qkv_proj", "gate_up_proj") else targets
            present = [t for t in names if (layer, t) in found]
            if not present:
                continue
            products[product] = _stack(layer, names, present, found, out_rows, info, dtype, device)
        layers.append(products)
    return LoraAdapter(info, tuple(layers))


def _stack(layer: int, names: tuple[str, ...], present: list[str], found: dict[tuple[int, str], dict[str, torch.Tensor]],
           out_rows: dict[str, tuple[int, int]], info: AdapterInfo, dtype: torch.dtype,
           device: torch.device) -> LowRank:
    """One fused product's pair: each present target's A rows stacked, its B at its output rows."""
    total_out = sum(out_rows[t][0] for t in names)
    total_rank = sum(found[(layer, t)]["A"].shape[0] for t in present)
    a = torch.cat([found[(layer, t)]["A"] for t in present])  # [total_rank, in_features]
    b = torch.zeros(total_out, total_rank)  # [out_features, total_rank]
    row, col = 0, 0
    for target in names:
        rows = out_rows[target][0]
        if target in present:
            pair = found[(layer, target)]
            r = pair["A"].shape[0]
            b[row:row + rows, col:col + r] = pair["B"] * info.scalings[f"{layer}.{target}"]
            col += r
        row += rows
    return LowRank(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())


def adapter_bytes(info: AdapterInfo, spec: DecoderSpec, dtype: torch.dtype) -> int:
    """The bytes `load_adapter` keeps for this adapter (B's zero rows of untargeted outputs included)."""
    out_rows = _target_shapes(spec)
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for layer in range(spec.num_layers):
        for product, targets in FUSED_TARGETS.items():
            names = (product,) if spec.fused_checkpoint and product in ("qkv_proj", "gate_up_proj") else targets
            present = [t for t in names if f"{layer}.{t}" in info.ranks]
            if present:
                rank = sum(info.ranks[f"{layer}.{t}"] for t in present)
                total += rank * (out_rows[present[0]][1] + sum(out_rows[t][0] for t in names)) * size
    return total
