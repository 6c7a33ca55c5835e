"""The weight plan (pagecli/models/weight_plan.py): one pure decision of how each weight is kept and what runs
it, for every dtype, --quantize and kernel build; and an engine's model holds exactly the products its plan
names (weight_forms.py applies it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagecli import native
from pagecli.config import EngineConfig
from pagecli.engine import Engine
from pagecli.errors import PagecliError
from pagecli.models.layers import Linear
from pagecli.models.quantize import Int8Reference
from pagecli.models.quantize_int4 import Int4Reference
from pagecli.models.weight_plan import FORMS, plan_weights

CPU = torch.device("cpu")


def kernels(kind: str = "avx2", packed: bool = False, amx: bool = False, panels: bool = True) -> SimpleNamespace:
    """A stand-in for pagecli.native's module: what the plan asks of it."""
    return SimpleNamespace(int8_linear_kind=lambda: kind, int4_linear_kind=lambda: kind,
                           has_packed_linear=lambda: packed, has_amx=lambda: amx,
                           has_bf16_weight_linear=lambda: panels)


Q4_1_FILE = {"Q4_1": 210}


@pytest.mark.parametrize(("dtype", "ops", "gguf", "expected"), [
    (torch.float32, kernels(), Q4_1_FILE, "gguf"),  # the embedded model on an AVX2 CPU
    (torch.float32, kernels("avx512_vnni"), Q4_1_FILE, "gguf"),  # float32 rounds to int16 everywhere
    (torch.bfloat16, kernels("avx512_vnni"), Q4_1_FILE, "none"),  # bf16 would round to int8
    (torch.float32, None, Q4_1_FILE, "none"),  # no kernels: the converted floats
    (torch.float32, kernels(""), Q4_1_FILE, "none"),  # kernels without quantized products
    (torch.float32, kernels(), None, "none"),  # not from a GGUF file
    (torch.float32, kernels(), {"Q6_K": 30, "F16": 2}, "none"),  # no blocks that run as they lie
])
def test_auto_runs_a_gguf_files_blocks_only_where_that_is_exact_to_2_16(dtype, ops, gguf, expected):
    plan = plan_weights(dtype, CPU, "auto", ops, gguf)
    assert plan.quantize == expected and plan.requested == "auto"
    assert plan.why.startswith("--quantize auto")


def test_the_unquantized_forms_follow_the_dtype_and_the_level():
    f32 = plan_weights(torch.float32, CPU, "none", kernels())
    assert (f32.decoder, f32.output, f32.decode_step) == ("float-panels", "float-panels", True)
    assert plan_weights(torch.float32, CPU, "none", kernels("avx512_vnni", packed=True)).decoder == "float-panels"
    assert plan_weights(torch.float32, CPU, "none", kernels(panels=False)).decoder == "float"  # a build without them
    bf16 = plan_weights(torch.bfloat16, CPU, "none", kernels("avx512_vnni", packed=True))
    assert (bf16.decoder, bf16.output, bf16.floats, bf16.row_kernel) == ("bf16-panels", "bf16-panels", "bf16-panels", True)
    amx = plan_weights(torch.bfloat16, CPU, "none", kernels("avx512_vnni", packed=True, amx=True))
    assert amx.decoder == amx.floats == "float"  # the AMX kernels read the weights as they lie
    torch_path = plan_weights(torch.float32, CPU, "none", None)
    assert (torch_path.decoder, torch_path.native, torch_path.decode_step) == ("float", False, False)


def test_rows_are_exact_only_where_every_product_gives_a_row_its_bits_alone():
    f32, bf16_vnni, amx, avx2 = kernels(), kernels("avx512_vnni", packed=True), kernels(amx=True), kernels()
    assert plan_weights(torch.float32, CPU, "none", f32).rows_exact(f32)  # float32 panels
    assert plan_weights(torch.float32, CPU, "gguf", f32, Q4_1_FILE).rows_exact(f32)  # the blocks, native
    assert plan_weights(torch.bfloat16, CPU, "none", bf16_vnni).rows_exact(bf16_vnni)  # bf16 panels
    assert plan_weights(torch.bfloat16, CPU, "none", amx).rows_exact(amx)  # AMX tiles over the weights as they lie
    assert not plan_weights(torch.bfloat16, CPU, "none", avx2).rows_exact(avx2)  # oneDNN's bf16 products
    no_panels = kernels(panels=False)
    assert not plan_weights(torch.float32, CPU, "none", no_panels).rows_exact(no_panels)  # PyTorch's float32 GEMM
    assert not plan_weights(torch.float32, CPU, "int8", None).rows_exact(None)  # the PyTorch reference


def test_switches_turn_the_panels_and_the_team_off(monkeypatch):
    monkeypatch.setenv("PAGECLI_BF16_WEIGHTS", "0")
    monkeypatch.setenv("PAGECLI_PACKED_GEMM", "0")
    monkeypatch.setenv("PAGECLI_DECODE_TEAM", "0")
    assert plan_weights(torch.float32, CPU, "none", kernels()).decoder == "float"
    bf16 = plan_weights(torch.bfloat16, CPU, "none", kernels("avx512_vnni", packed=True))
    assert bf16.decoder == "float" and not bf16.decode_team


def test_quantized_forms_round_activations_by_dtype_and_fall_back_to_pytorch_without_kernels():
    int4 = plan_weights(torch.bfloat16, CPU, "int4", kernels("avx512_vnni"))
    assert (int4.decoder, int4.output, int4.int16_activations, int4.decode_step) == ("int4", "int8", False, True)
    assert plan_weights(torch.float32, CPU, "int8", kernels("avx512_vnni")).int16_activations
    reference = plan_weights(torch.float32, CPU, "int8", None)
    assert (reference.int8_native, reference.decode_step) == (False, False)
    vnni_gguf = plan_weights(torch.bfloat16, CPU, "gguf", kernels("avx512_vnni"), Q4_1_FILE)
    assert not vnni_gguf.q8_0_as_is and vnni_gguf.output == "float"  # Q8_0 requantized; the output keeps floats
    avx2_gguf = plan_weights(torch.float32, CPU, "gguf", kernels(), Q4_1_FILE)
    assert avx2_gguf.q8_0_as_is and avx2_gguf.output == "gguf"
    assert [avx2_gguf.gguf_form(t) for t in ("Q4_0", "Q4_1", "Q8_0", "Q6_K")] == ["int4", "int4", "int8", "float"]


@pytest.mark.parametrize(("dtype", "ops", "file_output", "expected"), [
    (torch.bfloat16, kernels("avx512_vnni"), "Q6_K", "int8"),  # llama-quantize's Q4_0 files: 1.06 bytes a weight, not 2
    (torch.float32, kernels(), "Q6_K", "int8"),  # int16 activations on the AVX2 kernel, not 4-byte panels
    (torch.bfloat16, kernels("avx512_vnni"), "Q8_0", "int8"),  # requantized, as the decoder's Q8_0 matrices are
    (torch.float32, kernels(), "Q8_0", "gguf"),  # as it lies
    (torch.bfloat16, kernels("avx512_vnni"), "F16", "float"),  # a float type keeps its floats
    (torch.bfloat16, kernels("avx512_vnni"), None, "float"),  # a tied table (the file has no output.weight)
    (torch.float32, None, "Q6_K", "float"),  # no native int8 kernel: PyTorch's floats
])
def test_a_gguf_files_own_rounded_output_layer_runs_on_int8_blocks(dtype, ops, file_output, expected):
    plan = plan_weights(dtype, CPU, "gguf", ops, Q4_1_FILE, gguf_output=file_output)
    assert plan.output == expected
    if expected == "int8":
        assert "output layer: int8" in plan.describe()


def test_auto_runs_a_mixture_of_experts_gguf_on_its_blocks_in_any_dtype():
    """A dense GGUF model in bf16 keeps its floats under --quantize auto; a mixture of experts runs the file's
    blocks in bf16 too (its floats would be 3.5x the file); neither where no native kernel runs the blocks."""
    vnni = kernels("avx512_vnni")
    assert plan_weights(torch.bfloat16, CPU, "auto", vnni, Q4_1_FILE).quantize == "none"
    moe = plan_weights(torch.bfloat16, CPU, "auto", vnni, Q4_1_FILE, experts=True)
    assert (moe.quantize, moe.int16_activations) == ("gguf", False) and "mixture of experts" in moe.why
    assert plan_weights(torch.float32, CPU, "auto", vnni, Q4_1_FILE, experts=True).quantize == "gguf"
    assert plan_weights(torch.bfloat16, CPU, "auto", None, Q4_1_FILE, experts=True).quantize == "none"
    assert plan_weights(torch.bfloat16, CPU, "auto", vnni, None, experts=True).quantize == "none"  # not a GGUF


def test_what_cannot_run_is_refused_in_one_sentence():
    with pytest.raises(PagecliError, match="CPU only"):
        plan_weights(torch.bfloat16, torch.device("cuda"), "int4", None)
    with pytest.raises(PagecliError, match="not loaded from a .gguf file"):
        plan_weights(torch.float32, CPU, "gguf", kernels(), None)
    with pytest.raises(PagecliError, match="--quantize must be"):
        plan_weights(torch.float32, CPU, "int3", kernels())


def test_every_form_is_described():
    for dtype, quantize, gguf in ((torch.float32, "none", None), (torch.float32, "gguf", Q4_1_FILE),
                                  (torch.bfloat16, "int8", None), (torch.bfloat16, "int4", None)):
        plan = plan_weights(dtype, CPU, quantize, kernels("avx512_vnni", packed=True), gguf)
        line = plan.describe()
        assert FORMS[plan.decoder] in line and str(dtype).removeprefix("torch.") in line
        assert plan.summary().startswith(str(dtype).removeprefix("torch."))


PRODUCT_OF_FORM = {
    "float": lambda p: p is None,
    "bf16-panels": lambda p: type(p).__name__ == "PackedLinear",
    "float-panels": lambda p: type(p).__name__ == "F32PanelLinear",
    "int8": lambda p: type(p).__name__ == "PackedLinearInt8" or isinstance(p, Int8Reference),
    "int4": lambda p: type(p).__name__ == "PackedLinearInt4" or isinstance(p, Int4Reference),
}


@pytest.mark.parametrize(("dtype", "quantize"), [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"),
                                                 ("bfloat16", "int4")])
def test_an_engines_model_holds_the_products_its_plan_names(tiny_model_factory, dtype, quantize):
    config = EngineConfig(dtype=dtype, quantize=quantize, disk_cache=False, num_blocks=32, block_size=4)
    with Engine(str(tiny_model_factory("llama")), config) as engine:
        plan, model = engine.plan, engine.loaded.model
        assert (plan.quantize, str(plan.dtype)) == (quantize, f"torch.{dtype}")
        linears = [m for m in model.model.layers.modules() if isinstance(m, Linear)]
        assert linears and all(PRODUCT_OF_FORM[plan.decoder](m.packed) for m in linears), plan.decoder
        if plan.output != "float":
            assert PRODUCT_OF_FORM[plan.output](model.output_packed), plan.output
        assert (model.decode_step is not None) == plan.decode_step
        assert plan.native == (native.cpu_ops() is not None)
        assert engine.stats().weight_forms == plan.summary()


@pytest.mark.parametrize("amx", [False, True])
def test_auto_dtype_takes_the_blocks_for_one_stream_and_bf16_for_many(smollm2_dir, monkeypatch, amx):
    """On CPUs with bf16 arithmetic (Zen 4/5's AVX512-BF16, AMX), one stream decodes faster on the file's
    blocks (float32), many sequences in bf16."""
    from pagecli.models import loader
    from pagecli.models.weight_plan import blocks_choose_float32, plan_for_folder

    ops = kernels("avx512_vnni", packed=True, amx=amx)
    assert blocks_choose_float32("auto", CPU, ops, Q4_1_FILE, one_stream=True)
    assert not blocks_choose_float32("auto", CPU, ops, Q4_1_FILE, one_stream=False)
    assert not blocks_choose_float32("none", CPU, ops, Q4_1_FILE, one_stream=True)  # the converted floats asked for
    assert not blocks_choose_float32("auto", CPU, ops, {"Q6_K": 30}, one_stream=True)  # nothing runs as it lies
    assert not blocks_choose_float32("auto", CPU, None, Q4_1_FILE, one_stream=True)
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: True)  # as resolve_dtype sees such a CPU
    one = plan_for_folder(smollm2_dir, "auto", CPU, "auto", ops, one_stream=True)
    assert (one.dtype, one.quantize) == (torch.float32, "gguf")
    assert plan_for_folder(smollm2_dir, "auto", CPU, "auto", ops).dtype == torch.bfloat16
    assert plan_for_folder(smollm2_dir, "bfloat16", CPU, "auto", ops, one_stream=True).dtype == torch.bfloat16
    assert plan_for_folder(smollm2_dir, "auto", CPU, "none", ops, one_stream=True).dtype == torch.bfloat16


def test_chat_and_a_one_line_generate_run_as_one_stream(tmp_path):
    """chat and a generate of one line (one candidate) build their engine with max_num_seqs 1, the signal
    `--dtype auto` reads (EngineConfig.for_one_stream); two lines, or n > 1, do not."""
    from pagecli.batch.requests import BatchRequest
    from pagecli.cli.generate import _one_stream
    from pagecli.config import EngineConfig, RunSettings, SamplingParams
    from pagecli.config.profiles import load_profile

    assert EngineConfig().for_one_stream().max_num_seqs == 1
    assert EngineConfig(max_num_seqs=1).for_one_stream() == EngineConfig(max_num_seqs=1)
    settings = RunSettings(None, load_profile(None), EngineConfig(), SamplingParams())
    line = BatchRequest(1, "a", "hello")
    assert _one_stream(settings, [line])
    assert not _one_stream(settings, [line, BatchRequest(2, "b", "again")])
    assert not _one_stream(settings, [BatchRequest(1, "a", "hello", sampling={"n": 2})])
    assert not _one_stream(settings, [BatchRequest(1, "a", "hello", sampling={"temperature": -3})])  # refused later
