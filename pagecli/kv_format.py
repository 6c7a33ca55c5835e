"""How K and V lie in the paged cache: the model's float dtype, or 8 bits with a scale per row.

`--kv-dtype` picks a format. `auto` stores K/V in the model's dtype, as before; `bfloat16`,
`float16` and `float32` store them in that dtype. `int8` and `fp8` store each (token, kv head) row
of head_dim values in one byte each, followed by that row's scale as a float16 (2 bytes, little
endian), so a block carries its own scales wherever it goes (copy-on-write, the disk store):

    cache [num_blocks, block_size, kv_heads, head_dim + 2]   row = head_dim data bytes | fp16 scale

The cache tensor's dtype names the format, so kernels dispatch on it and need no extra argument:

    int8  (torch.int8):  value = data (int8, -127..127) * scale, scale = max|x| / 127
    fp8   (torch.uint8): value = e4m3fn(data) * scale,           scale = max|x| / 448

Quantizing rounds the fp32 value x * (1 / scale) half to even (int8) or as torch converts float32 to
float8_e4m3fn (fp8), after clamping to the format's range; the scale is max|x| over the row in fp32
divided as shown, rounded to float16. A row of zeros has scale 0 and data 0. The compiled kernels
(pagecli.native, pagecli.kernels) write the same bytes as `quantize_rows` below, which is the
reference they are tested against.

With head_dim 64 the scale costs 2 bytes per 64: 1/32 of the int8 data, so an int8 pool holds 1.94x
the tokens of a bfloat16 one (2x less the scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagecli.config.settings import KV_DTYPE_CHOICES
from pagecli.errors import PagecliError

QUANTIZED_KV = ("int8", "fp8")
SCALE_BYTES = 2  # float16
_FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_STORAGE = {"int8": torch.int8, "fp8": torch.uint8}
_RANGE = {"int8": 127.0, "fp8": 448.0}


@dataclass(frozen=True)
class KVFormat:
    """One cache format: `name` is a KV_DTYPE_CHOICES entry other than auto."""

    name: str
    head_dim: int

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZED_KV

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype (for int8/fp8 it also tells the kernels which format they read)."""
        return _STORAGE[self.name] if self.quantized else _FLOAT_DTYPES[self.name]

    @property
    def row_width(self) -> int:
        """Elements of the cache's last dimension: head_dim, plus 2 scale bytes when quantized."""
        return self.head_dim + SCALE_BYTES if self.quantized else self.head_dim

    def bytes_per_token(self, num_layers: int, num_kv_heads: int) -> int:
        """K and V of one token in every layer."""
        element = 1 if self.quantized else self.storage_dtype.itemsize
        return num_layers * 2 * num_kv_heads * self.row_width * element

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, num_kv_heads, self.row_width)


def resolve_kv_format(kv_dtype: str, model_dtype: torch.dtype, head_dim: int) -> KVFormat:
    """The format `--kv-dtype` asks for with a model of this dtype (auto: the model's own)."""
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise PagecliError(f"--kv-dtype must be one of {', '.join(KV_DTYPE_CHOICES)} (got '{kv_dtype}').")
    if kv_dtype == "auto":
        return KVFormat(str(model_dtype).removeprefix("torch."), head_dim)
    if kv_dtype in QUANTIZED_KV and head_dim % 16:
        raise PagecliError(f"--kv-dtype {kv_dtype} needs a head size that is a multiple of 16 (this model's is "
                           f"{head_dim}); use --kv-dtype auto.")
    return KVFormat(kv_dtype, head_dim)


def format_of_cache(cache: torch.Tensor) -> str | None:
    """'int8' or 'fp8' for a quantized cache tensor (by its dtype), None for a float one."""
    for name, dtype in _STORAGE.items():
        if cache.dtype == dtype:
            return name
    return None


def quantize_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """Rows x [..., head_dim] (any float dtype) -> cache rows [..., head_dim + 2] in the format's storage
    dtype: the reference every kernel that writes a quantized cache matches byte for byte."""
    limit = _RANGE[name]
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / limit).to(torch.float16)  # [..., 1]
    scale32 = scale.float()
    inverse = torch.where(scale32 > 0, 1.0 / scale32, torch.zeros_like(scale32))
    scaled = (x32 * inverse).clamp(-limit, limit)
    if name == "int8":
        data = torch.round(scaled).to(torch.int8).view(torch.uint8)
    else:
        data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    scale_bytes = scale.view(torch.uint8)  # [..., 2], little endian
    return torch.cat([data, scale_bytes], dim=-1).view(_STORAGE[name])


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., head_dim + 2] of a quantized cache -> values [..., head_dim] in `dtype`."""
    name = format_of_cache(rows)
    if name is None:
        return rows.to(dtype)
    raw = rows.view(torch.uint8)
    head_dim = raw.shape[-1] - SCALE_BYTES
    scale = raw[..., head_dim:].contiguous().view(torch.float16).float()  # [..., 1]
    data = raw[..., :head_dim]
    values = data.view(torch.int8).float() if name == "int8" else data.view(torch.float8_e4m3fn).float()
    return (values * scale).to(dtype)
