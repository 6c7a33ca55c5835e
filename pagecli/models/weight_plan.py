"""How every weight is kept and which product runs it, decided in one place.

`plan_weights` is a pure function of the model's dtype, the device, `--quantize`, what pagecli's CPU
kernels offer (`ops`, None off the CPU or without them) and, for a model converted from a GGUF file,
its decoder tensors' types. It returns a `WeightPlan`: the form of the decoder layers' products and of
the output layer's, what the quantized products round activations to, which kernels run the steps
between products, and whether the one-call native decode step applies. weight_forms.py applies a plan
to a CausalLM layer by layer as it loads; the engine makes one call of each; `pagecli doctor`,
`python -m pagecli.native` and the start-up line print `plan.describe()`.

The forms (FORMS below says each in words):
- `float`: the weight as loaded, in the model's dtype; PyTorch's product (a bf16 one on pagecli.native's
  row kernels: AMX tiles, AVX512-BF16 rows, oneDNN, by shape).
- `bf16-panels`: a bf16 model's weights repacked once into the packed GEMM's panels (AVX512-BF16 without
  AMX): a row's result has the same bits in any batch.
- `float-panels`: a float32 model's weights in 16-column panels (every level), kept in bf16 where
  every value is a bfloat16 (a model converted from bf16: half the bytes, the same values).
- `int8`: int8 with a bf16 scale per output channel and 64-block (quantize.py).
- `int4`: 4-bit groups of 32 with an fp16 scale and minimum (quantize_int4.py).
- `gguf`: the GGUF file's own blocks, per tensor: Q4_0/Q4_1 on the int4 kernel, Q8_0 as it is on the
  AVX2 int8 kernel (else requantized to int8), other types on the converted floats (`gguf_form`).

A mixture of experts' experts are Linears like any other and take the decoder's form; its router keeps
the model's floats under a quantized form (a Linear that `keeps_floats`: rounding it could pick other
experts); the one-call decode step runs its router and experts (pagecli/native/moe_experts.h).

Adding a weight form: a name in FORMS, its choice here, its product in weight_forms.py. Neither the
engine nor the model changes (docs/ARCHITECTURE.md lists the files).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from pagecli.errors import PagecliError
from pagecli.models.gguf_files import AS_IS_TYPES, quantized_type
from pagecli.native.interface import CpuOps

FORMS = {
    "float": "the loaded floats, PyTorch's product",
    "bf16-panels": "bf16 in the packed GEMM's panels",
    "float-panels": "float32 panels, bf16 where every value is a bfloat16",
    "int8": "int8, a scale per output channel and 64-block",
    "int4": "4-bit groups of 32 (scale and minimum)",
    "gguf": "the GGUF file's own blocks",
}
SHORT = {  # the forms in a few words, for the start-up line
    "float": "the loaded floats",
    "bf16-panels": "bf16 panels",
    "float-panels": "float32 panels (bf16 where exact)",
    "int8": "int8 weights",
    "int4": "int4 weights",
    "gguf": "the GGUF file's own blocks",
}
QUANTIZED = ("int8", "int4", "gguf")

_OFF = ("0", "false", "no", "off")
PACKED_GEMM_VAR = "PAGECLI_PACKED_GEMM"  # 0: bf16 models keep row-layout weights (A/B runs)
FLOAT_PANELS_VAR = "PAGECLI_BF16_WEIGHTS"  # 0: float32 models keep PyTorch's products (A/B runs)
DECODE_TEAM_VAR = "PAGECLI_DECODE_TEAM"  # 0: a parallel region per kernel in the decode step (A/B runs)
GREEDY_IN_OUTPUT_VAR = "PAGECLI_GREEDY_IN_OUTPUT"  # 0: the greedy choice in a pass of its own (A/B runs)


def _switched_off(variable: str) -> bool:
    return os.environ.get(variable, "1").strip().lower() in _OFF


def bf16_panels_offered(ops: CpuOps | None) -> bool:
    """Whether bf16 models put their weights in the packed GEMM's panels: where the build has it
    (AVX512-BF16) and the CPU grants no AMX tiles (the AMX kernels read the weights as they lie and were
    not measured against it), unless PAGECLI_PACKED_GEMM=0."""
    return ops is not None and not _switched_off(PACKED_GEMM_VAR) and bool(ops.has_packed_linear()) \
        and not ops.has_amx()


def float_panels_offered(ops: CpuOps | None) -> bool:
    """Whether float32 models put their weights in float32 panels (bf16 where exact), on every compiled
    level (each build has the AVX2 + FMA kernel), unless PAGECLI_BF16_WEIGHTS=0. Halves the bytes a decode
    step reads where the weights allow, and a row's result has the same bits alone or in any batch: a
    prompt gives the same logits whole, in chunks or after a prefix hit (PyTorch's float32 GEMM sums a few
    rows otherwise than many; tests/test_native_prefill_bits.py). The products are the same numbers,
    summed in another order than PyTorch's."""
    return ops is not None and not _switched_off(FLOAT_PANELS_VAR) and bool(ops.has_bf16_weight_linear())


def decode_team_wanted() -> bool:
    """Whether the decode step runs a step of a few rows in one parallel region (decode_step.h's
    forward_team) where it can, unless PAGECLI_DECODE_TEAM=0 (the results are the same bits either way)."""
    return not _switched_off(DECODE_TEAM_VAR)


def greedy_in_output_wanted() -> bool:
    """Whether the output layer's native products take each row's greedy choice as they write the logits
    (greedy_choices.h), unless PAGECLI_GREEDY_IN_OUTPUT=0 (greedy_tokens' pass then: the same tokens)."""
    return not _switched_off(GREEDY_IN_OUTPUT_VAR)


def kernel_takes(kind: str, dtype: torch.dtype) -> bool:
    """Whether a native quantized kernel of this kind (ops.int8_linear_kind() or int4_linear_kind()) takes
    activations of this dtype: the AVX2 and AVX512-VNNI ones take float32, bf16 and fp16."""
    return kind in ("avx2", "avx512_vnni") and dtype in (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class WeightPlan:
    """How this model's weights are kept and run (module docstring). Every field is decided by plan_weights."""

    quantize: str  # the --quantize that runs: none, int8, int4 or gguf (auto resolved)
    requested: str  # --quantize as given (auto, none, int8, int4, gguf)
    dtype: torch.dtype  # the model's floats (activations, norms, the embedding table)
    decoder: str  # the decoder layers' products: a FORMS key
    output: str  # the output layer's: a FORMS key (gguf: Q8_0 blocks as they lie where the file has them)
    native: bool  # the steps between products (norms, rotary, SiLU, attention) on pagecli.native's kernels
    int8_native: bool  # int8 products on pagecli.native (else the PyTorch reference)
    int4_native: bool  # 4-bit products on pagecli.native (else the PyTorch reference)
    int16_activations: bool  # quantized products round activations to int16 per 64 (exact to 2^-16), not int8
    q8_0_as_is: bool  # GGUF Q8_0 blocks run as they lie (the AVX2 int8 kernel), else requantized to int8
    floats: str  # the form float products left over take (GGUF types that are not blocks, a Q6_K output
    # layer, a MoE router): bf16-panels, float-panels or float (the dtype's float form)
    row_kernel: bool  # bf16 products of row-layout weights on pagecli.native's row kernels
    decode_step: bool  # decode-only steps run the whole layer loop in one C++ call
    decode_team: bool  # ... as one parallel region where the step has few rows
    greedy_in_output: bool  # the output layer's native product takes each row's greedy choice as it writes them
    why: str  # one sentence: why this quantize (the default's choice, or the flag)

    def gguf_form(self, type_name: str) -> str:
        """The form a GGUF tensor of this type takes under --quantize gguf: int4, int8 or float."""
        if type_name in ("Q4_0", "Q4_1"):
            return "int4"
        if type_name == "Q8_0":
            return "int8"
        return "float"

    def rows_exact(self, ops: CpuOps | None) -> bool:
        """Whether each product gives a row the same bits alone as among others (what speculation's checking
        passes need to give plain decoding's tokens): the panels and the native quantized kernels do, and AMX
        tiles; PyTorch's products of the `float` form do not (its float32 GEMM, and oneDNN's bf16 one behind the
        row kernels: on a forced avx2 level a checking pass's rows changed sampled outputs), nor quantized
        forms run in PyTorch (no one-call decode step)."""
        amx_tiles = self.dtype == torch.bfloat16 and ops is not None and bool(ops.has_amx())
        forms = {self.decoder, self.output, self.floats}
        return self.decode_step and ("float" not in forms or amx_tiles)

    def rounds_wide(self, ops: CpuOps | None) -> bool:
        """Whether this plan's 4-bit products round activations to int16 on the VNNI panels (quant_int4.cpp's wide
        tiles, 32639 levels) rather than on the AVX2 kernel (32767): their KV bytes differ a little, so the disk
        prefix store keeps them apart (models/fingerprint.kv_fingerprint_name)."""
        return (self.int16_activations and self.int4_native and self.quantize in ("int4", "gguf") and ops is not None
                and ops.int4_linear_kind() == "avx512_vnni")

    def summary(self) -> str:
        """A few words for the start-up line: the dtype and the forms."""
        words = f"{str(self.dtype).removeprefix('torch.')}, {SHORT[self.decoder]}"
        if self.output != self.decoder:
            words += f", output layer as {SHORT[self.output]}"
        return words

    def describe(self) -> str:
        """One line for the start-up output, `pagecli doctor` and `python -m pagecli.native`."""
        dtype = str(self.dtype).removeprefix("torch.")
        parts = [f"{dtype}; decoder products: {FORMS[self.decoder]}"]
        if self.decoder == "gguf":
            q8 = "Q8_0 as it lies" if self.q8_0_as_is else "Q8_0 requantized to int8"
            parts[0] += f" (Q4_0/Q4_1 in 4 bits, {q8}, other types as floats)"
        if self.output != self.decoder:
            parts.append(f"output layer: {FORMS[self.output]}")
        if self.quantize != "none":
            rounding = "int16 per 64 (exact to 2^-16)" if self.int16_activations else "int8 per 64"
            runs = "pagecli.native" if (self.int8_native and self.int4_native) else "the PyTorch reference"
            parts.append(f"activations rounded to {rounding}, run by {runs}")
        if self.decode_step:
            parts.append("decode steps in one native call")
        return "; ".join(parts) + f" ({self.why})"


def plan_weights(dtype: torch.dtype, device: torch.device, quantize: str, ops: CpuOps | None,
                 gguf_types: Mapping[str, int] | None = None, one_call_shaped: bool = True,
                 gguf_output: str | None = None, experts: bool = False) -> WeightPlan:
    """The plan for a model of this dtype on this device. quantize: --quantize as given; ops: the CPU
    kernels (None on a GPU or without them); gguf_types: how many decoder matrices each GGUF type holds, for
    a model converted from a .gguf file (gguf_files.tensor_types), else None; one_call_shaped: whether the
    architecture's layers are the ones the one-call decode step runs (DecoderSpec.one_call_shaped: not
    Gemma's soft-capping, sliding layers, norms after each block and GeGLU, nor partial rotary);
    gguf_output: the GGUF type of the file's own output layer (gguf_files.output_type: None for a tied table);
    experts: the model is a mixture of experts (DecoderSpec.moe). Refuses --quantize off the CPU, and gguf for another model."""
    if quantize not in ("auto", "none", *QUANTIZED):
        raise PagecliError(f"--quantize must be auto, none, int8, int4 or gguf (got '{quantize}').")
    if quantize in QUANTIZED and device.type != "cpu":
        raise PagecliError(f"--quantize {quantize} runs on the CPU only; use --device cpu or --quantize none.")
    if quantize == "gguf" and gguf_types is None:
        raise PagecliError("--quantize gguf runs a .gguf model's own quantized weights; this model was not "
                           "loaded from a .gguf file (use int8 or int4).")
    int8_native = ops is not None and kernel_takes(ops.int8_linear_kind(), dtype)
    int4_native = ops is not None and kernel_takes(ops.int4_linear_kind(), dtype)
    int16 = dtype == torch.float32  # float32 models round to int16 on every level; bf16/fp16 to int8 where VNNI
    q8_0_as_is = int8_native and (int16 or ops.int8_linear_kind() == "avx2")
    resolved, why = _resolve(quantize, dtype, ops, int8_native, int4_native, int16, gguf_types, experts)
    float_form = ("float-panels" if dtype == torch.float32 and float_panels_offered(ops)
                  else "bf16-panels" if dtype == torch.bfloat16 and bf16_panels_offered(ops) else "float")
    decoder = float_form if resolved == "none" else resolved
    if resolved in ("int8", "int4"):
        output = "int8"  # as llama.cpp's quantized files keep theirs (Q8_0, Q6_K)
    elif resolved == "gguf" and gguf_output == "Q8_0" and q8_0_as_is:
        output = "gguf"  # its blocks as they lie
    elif resolved == "gguf" and gguf_output is not None and quantized_type(gguf_output) and int8_native:
        # An output layer its maker rounded (llama-quantize's Q6_K, or Q8_0 where the VNNI kernel runs):
        # int8 blocks of 64 from its values read 1.06 bytes a weight, the float panels 2 or 4 (OLMoE-1B-7B's
        # shape: 104 MB a token against 201 in bf16; the loss in docs/benchmarks/gguf-perplexity.md).
        output = "int8"
    elif resolved == "gguf":
        output = "gguf" if q8_0_as_is else float_form  # a tied table: Q8_0 as it lies, else the floats
    else:
        output = float_form
    # The kernels each quantize needs (the output layer of int4 runs int8); without them a product runs in PyTorch.
    needs = {"int8": int8_native, "int4": int4_native and int8_native, "gguf": int8_native and int4_native}
    in_pytorch = resolved in needs and not needs[resolved]
    return WeightPlan(
        quantize=resolved, requested=quantize, dtype=dtype, decoder=decoder, output=output,
        native=ops is not None, int8_native=int8_native, int4_native=int4_native, int16_activations=int16,
        q8_0_as_is=q8_0_as_is, floats=float_form,
        row_kernel=ops is not None and dtype == torch.bfloat16,
        decode_step=ops is not None and not in_pytorch and one_call_shaped, decode_team=decode_team_wanted(),
        greedy_in_output=ops is not None and greedy_in_output_wanted(), why=why,
    )


def _resolve(quantize: str, dtype: torch.dtype, ops: CpuOps | None, int8_native: bool, int4_native: bool,
             int16: bool, gguf_types: Mapping[str, int] | None, experts: bool = False) -> tuple[str, str]:
    """--quantize auto (the default): a .gguf model's own blocks where a float32 model runs them on the
    native kernels that round activations to int16 (the converted floats' numbers to 2^-16 of each
    activation block, KL 2e-7 on the embedded model, for a fifth of the bytes a decode step reads), and a
    mixture of experts' blocks in any dtype (its bf16 floats would hold 3.5x the file's bytes, 14 GB for
    OLMoE-1B-7B's 3.9 GB Q4_0 file, and a token would read its experts at 16 bits a weight; bf16 rounds
    the activations to int8 per 64 on the blocks, as llama.cpp's own products do); the converted floats
    everywhere else (dense bf16 and fp16 models, whose quantized products round activations to int8; the
    PyTorch path; GPUs; other files)."""
    if quantize != "auto":
        return quantize, f"--quantize {quantize}"
    if gguf_types is None:
        return "none", "--quantize auto: the checkpoint's floats"
    if ops is None:
        return "none", "--quantize auto: no CPU kernels to run the file's blocks"
    if not (int8_native and int4_native):
        return "none", "--quantize auto: no native kernels here for the file's blocks"
    if not any(kind in AS_IS_TYPES for kind in gguf_types):
        return "none", "--quantize auto: the file has no Q4_0, Q4_1 or Q8_0 blocks to run"
    if int16:
        return "gguf", "--quantize auto: float32 runs the file's blocks on the int16 kernels"
    if experts:
        return "gguf", ("--quantize auto: a mixture of experts runs the file's blocks (its floats would be 3.5x "
                        "the file; activations rounded to int8 per 64)")
    return "none", "--quantize auto: a bf16 or fp16 model would round activations to int8 on the blocks"


def blocks_choose_float32(quantize: str, device: torch.device, ops: CpuOps | None,
                          gguf_types: Mapping[str, int] | None, one_stream: bool = False) -> bool:
    """Whether `--dtype auto` takes float32 rather than bfloat16 for a model converted from a GGUF file, where
    the file has blocks that run as they lie and the native kernels run them: float32 runs them with
    activations rounded to int16 (the converted floats' numbers to 2^-16), bfloat16 runs the converted floats
    rounded to bf16. A decode row then reads the blocks' 4-5 bits a weight instead of bf16's 16; the int16
    products gain less from more rows than bf16's, and a float32 KV cache is twice bf16's bytes.
    So float32 for a run of one stream (`one_stream`: at most one sequence at a time: chat, a one-line
    generate), bf16 otherwise, on every CPU with bf16 arithmetic (only there does `auto` offer bf16):
    - Xeon with AMX, 1 thread (docs/benchmarks/cpu-peers-amx.md, "The default dtype on AMX"): one stream
      decodes ~2.1x faster on the blocks, while 16 or 64 sequences, and prompts, run 2-6x faster on AMX's
      bf16 tiles.
    - AMD Zen 5 (AVX512-BF16, no AMX), 1 thread, with the 512-bit int16 tiles (docs/benchmarks/
      cpu-without-amx.md, "512-bit int16 tiles"): one stream 1.7x faster on the blocks; 16 sequences
      1.7-1.9x faster in bf16, 4 about even. (Zen 4, 2 threads, issue 43: one stream 119 tok/s on the
      blocks against 101 in bf16.)"""
    if quantize not in ("auto", "gguf") or device.type != "cpu" or ops is None or not one_stream:
        return False
    # float32 is the dtype whose blocks --quantize auto runs: where its plan would run them, take it
    return plan_weights(torch.float32, device, "auto", ops, gguf_types).quantize == "gguf"


def plan_for_folder(folder: Path, dtype: str | torch.dtype, device: torch.device, quantize: str,
                    ops: CpuOps | None, hf_config: Any = None, one_stream: bool = False) -> WeightPlan:
    """plan_weights for a model folder: its dtype (dtype: --dtype, resolved against its config, or the
    loaded model's; `auto` takes float32 where blocks_choose_float32), and the GGUF file it was converted
    from, if any, read through the folder's index. The engine loads the model in plan.dtype. hf_config: the
    folder's config where the caller has read it already (load_hf_config); one_stream: the run decodes one
    sequence at a time (blocks_choose_float32)."""
    from pagecli.models import gguf_files
    from pagecli.models.loader import load_hf_config, resolve_dtype
    from pagecli.models.spec import DecoderSpec

    source = gguf_files.gguf_source(folder) if quantize in ("auto", "gguf") else None
    gguf_types = None
    if source is not None:
        try:
            gguf_types = gguf_files.tensor_types(source, folder)
        except (PagecliError, OSError, ValueError):
            if quantize == "gguf":
                raise
            gguf_types = {}  # changed since its conversion: loading says so where weights lie in it
    if hf_config is None:
        hf_config = load_hf_config(folder)  # read once: the dtype and the architecture's shape
    if not isinstance(dtype, torch.dtype):
        auto = dtype == "auto"
        dtype = resolve_dtype(dtype, hf_config, device)
        if auto and dtype == torch.bfloat16 and blocks_choose_float32(quantize, device, ops, gguf_types, one_stream):
            dtype = torch.float32
    spec = DecoderSpec.from_hf_config(hf_config, folder / "config.json")
    output = gguf_files.output_type(source, folder) if gguf_types else None
    return plan_weights(dtype, device, quantize, ops, gguf_types, spec.one_call_shaped, output, spec.moe)
