"""A float32 model's quantized products (activations rounded to int16, panel_i16.h) give the same bits on
every compiled level and for every tile: AVX-512 builds run products of 4 or more rows on 512-bit tiles
of up to 8 rows by 2 panels, AVX2 builds and few-row products on the 256-bit tile of up to 3 rows by one
panel. Each group's integer sums are exact and folded lane for lane in the same order, so a row's result
must not depend on the level, the batch beside it or the tile that ran it. The int4 products of a VNNI
build are the exception to the level: they round to 32639 levels on the VNNI panels (quant_int4.cpp's wide
tiles), so there a row keeps its bits in any batch and tile of that level, and comes within the rounding of
the int16 reference of the other levels."""

from __future__ import annotations

import pytest
import torch

from native_levels import COMPILED_LEVELS, skip_without_native, threads
from pagecli import native
from pagecli.models.quantize import quantize_int8
from pagecli.models.quantize_int4 import quantize_int4

skip_without_native()

if len(COMPILED_LEVELS) < 2:
    pytest.skip("one compiled level on this CPU: nothing to compare it with", allow_module_level=True)

# Rows around the 512-bit tiles' edges (1-3 stay on the AVX2 tile; 4-8 one row block; 9-17 a remainder),
# a speculative check's 9, and a prompt's 130 (16 full blocks and a remainder of 2).
ROWS = (1, 3, 4, 5, 8, 9, 16, 17, 130)


def weights(kind: str, in_features: int, out_features: int):
    gen = torch.Generator().manual_seed(in_features * 3 + out_features)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen)
    if kind == "int4":
        return lambda ops: ops.PackedLinearInt4(*quantize_int4(w), b, int16_activations=True)
    q, scale = quantize_int8(w)
    if kind == "q8_0":  # a GGUF Q8_0 tensor's fp16 scales per 32, run as it lies
        scale = scale.float().repeat_interleave(2, dim=1)[:, : -(-in_features // 32)].half()
    return lambda ops: ops.PackedLinearInt8(q, scale, b, int16_activations=True)


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1000), (101, 40), (1536, 200)])
@pytest.mark.parametrize("kind", ["int8", "q8_0", "int4"])
def test_every_level_and_tile_gives_a_row_the_same_bits(kind, in_features, out_features):
    make = weights(kind, in_features, out_features)
    layers = {level: make(native.cpu_ops_for(level)) for level in COMPILED_LEVELS}
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(max(ROWS), in_features, generator=gen)
    x[2, :40] = 0  # a block that is partly zero
    with threads(2):
        alone = {level: torch.cat([layer.forward(x[m : m + 1]) for m in range(max(ROWS))])
                 for level, layer in layers.items()}
        for level, layer in layers.items():
            own = layer.kind == "avx512_vnni_i16"  # the wide tiles' own rounding (module docstring)
            expected = alone[level] if own else alone["avx2"]
            for rows in ROWS:
                got = layer.forward(x[:rows])
                assert torch.equal(got, expected[:rows]), f"{level}, {rows} rows: {(got - expected[:rows]).abs().max():.3g}"
            if own:  # within a few units of 2^-15 of the outputs' scale of the int16 kernel's results
                scale = alone["avx2"].abs().max()
                assert (alone[level] - alone["avx2"]).abs().max() <= 1e-4 * scale
