"""A WeightPlan applied to a CausalLM: each Linear handed the one product its form gives, the output layer's
too, and the kernels that run the steps between products.

`WeightPlacer(plan, ops)` gives load_model its per-layer hooks: `layer_provided` (the checkpoint weights a
GGUF file's blocks replace, never read) and `layer_ready` (a decoder layer put in its form as soon as its
weights are in, so a quantized or panelled model never holds all its float weights); `finish` then does
whatever the hooks did not (a model loaded before the plan), the output layer, the kernels, the weights'
large pages and the one-call decode step. The product constructors are `*_product` below; each returns
the product and the tensors it keeps, which the Linear holds as parameters (so byte counts see them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagecli.models.decoder import CausalLM, DecoderLayer
from pagecli.models.layers import GatedMLP, Linear, RMSNorm
from pagecli.models.lora import ATTENTION_PRODUCTS, LoraAdapter, LowRank
from pagecli.models.moe import SparseMoE
from pagecli.models.quantize import Int8Reference, int8_product, quantize_int8
from pagecli.models.quantize_int4 import Int4Reference, int4_product, quantize_int4
from pagecli.models.weight_plan import WeightPlan
from pagecli.native.interface import CpuOps

Kept = dict[str, torch.Tensor]  # a product's tensors, by the parameter name its Linear keeps them under


def panels_product(weight: torch.Tensor, bias: torch.Tensor | None, form: str, ops: CpuOps) -> tuple[Any, Kept]:
    """bf16-panels (the packed GEMM's PackedLinear) or float-panels (F32PanelLinear: bf16 where exact)."""
    kind = ops.PackedLinear if form == "bf16-panels" else ops.F32PanelLinear
    product = kind(weight.detach(), None if bias is None else bias.detach())
    return product, {"packed_weight": product.panels}


class WeightPlacer:
    """Puts a model's weights in the forms of `plan` (module docstring). ops: the CPU kernels, None for
    PyTorch's products; progress: a sentence now and then while a long load quantizes; after_layer: called
    once a layer's float weights are replaced (the engine returns their memory to the system there); merge:
    a LoRA adapter added into the weights (--merge-lora; the plan keeps floats, not a GGUF file's blocks)."""

    def __init__(self, plan: WeightPlan, ops: CpuOps | None, progress: Callable[[str], None] | None = None,
                 after_layer: Callable[[], None] | None = None, merge: LoraAdapter | None = None) -> None:
        self.plan, self.ops = plan, ops
        self.merge = merge  # a LoRA adapter merged into each layer's float weights before they take their form
        self.say = progress or (lambda message: None)
        self.after_layer = after_layer or (lambda: None)
        self._placed: set[int] = set()
        self._gguf: Any = None  # the file's GgufBlocks while layers are put on them
        self._gguf_products: dict[int, dict[tuple[str, str], Any]] = {}  # read ahead by layer_provided
        self._gguf_output_parts: Any = None  # the output layer's blocks, read ahead by layer_provided
        self._said = [0, time.monotonic()]  # layers done, when progress was last said
        if plan.quantize == "gguf" and plan.requested == "auto":
            self.say("Running the GGUF file's own quantized blocks as they lie (--quantize auto; "
                     "--quantize none runs their floats, dequantized from the file)")
        elif plan.quantize == "gguf":
            self.say("Putting the weights on the GGUF file's own blocks as they load")
        elif plan.quantize != "none":
            self.say(f"Quantizing the weights to {plan.quantize} as they load")

    # --- load_model's hooks ---------------------------------------------------------------------------
    @property
    def layer_provided(self) -> Callable[[CausalLM, int | None], frozenset[str]] | None:
        """load_model's layer_provided hook: under --quantize gguf, the checkpoint weights a layer's GGUF
        blocks replace (their floats are never read), and outside the layers (index None) a tied table
        that the output layer's Q8_0 blocks hold exactly; None otherwise."""
        return self._weights_on_blocks if self.plan.quantize == "gguf" else None

    def _weights_on_blocks(self, model: CausalLM, index: int | None) -> frozenset[str]:
        from pagecli.models import gguf_blocks

        if index is None:  # outside the layers: a tied table the output layer's Q8_0 blocks hold exactly
            self._gguf_output_parts = self._gguf_blocks(model).output()
            tied_q8 = (model.spec.tie_word_embeddings and self.plan.q8_0_as_is
                       and isinstance(self._gguf_output_parts, gguf_blocks.Q8Parts))
            return frozenset({"model.embed_tokens.weight"}) if tied_q8 else frozenset()
        products = self._gguf_blocks(model).layer(index)
        self._gguf_products[index] = products
        return gguf_blocks.weights_replaced(index, products, model.spec.fused_checkpoint)

    def layer_ready(self, model: CausalLM, index: int) -> None:
        """load_model's layer_ready hook: decoder layer `index` in its form, once its weights are in."""
        if index in self._placed:
            return
        self._placed.add(index)
        layer = model.model.layers[index]
        if self.merge is not None:
            merge_into_layer(layer, self.merge.layers[index])
        form = self.plan.decoder
        if form in ("float", "bf16-panels"):
            return  # kept as loaded (the packed GEMM's panels come in finish, with the output layer's)
        if form == "float-panels":  # the plan's form of float32 models only (_to_panels checks each weight)
            for linear in _linears(layer):
                self._to_panels(linear, form)
        elif form == "gguf":
            self._gguf_layer(model, index, layer)
        else:
            for linear in _linears(layer):
                self._quantize(linear, form)
        self.after_layer()
        self._progress(model.spec.num_layers)

    def _progress(self, num_layers: int) -> None:
        self._said[0] += 1
        if self.plan.quantize != "none" and time.monotonic() - self._said[1] >= 10 and self._said[0] < num_layers:
            done = "put on their blocks" if self.plan.quantize == "gguf" else f"quantized to {self.plan.quantize}"
            self.say(f"{self._said[0]} of {num_layers} layers loaded and {done}")
            self._said[1] = time.monotonic()

    # --- after loading ----------------------------------------------------------------------------------
    def finish(self, model: CausalLM) -> None:
        """Every layer not yet placed, the output layer, the kernels between products, large pages for the
        weights decode streams, and the one-call decode step where the plan has it."""
        for index in range(len(model.model.layers)):
            self.layer_ready(model, index)
        self._gguf = None  # the file's blocks are all in: let the reader's mapping go
        self._place_output(model)
        if self.ops is None:
            return
        ops = self.ops
        model.linear_kernel = ops.linear if self.plan.row_kernel else None
        for rotary in model.rotaries():
            rotary.kernel = ops.rotary_
        for module in model.modules():
            if isinstance(module, Linear):
                module.kernel = model.linear_kernel
                if self.plan.floats != "float" and module.packed is None:
                    self._to_panels(module, self.plan.floats)  # float products left over: row-invariant panels
            elif isinstance(module, RMSNorm):
                module.kernel = ops.add_rms_norm
            elif isinstance(module, GatedMLP) and module.activation == "silu":
                module.kernel = ops.silu_mul
        _stream_weights_from_large_pages(model, ops)
        model.decode_step = self._decode_step(model)
        # A soft-capped output (Gemma) is tanh of the product: two logits may round to one there, and the
        # first of them is not always the product's largest.
        model.output_chooses = (self.plan.greedy_in_output and model.spec.final_softcap is None
                                and hasattr(model.output_packed, "forward_choosing"))

    def _place_output(self, model: CausalLM) -> None:
        form = self.plan.output
        if form == "gguf":
            form = self._gguf_output(model)
        if form == "int8":
            weight = model.output_weight
            self._output_on_int8(model, *quantize_int8(weight))
        elif form in ("bf16-panels", "float-panels") and self.ops is not None:
            self._output_on_panels(model, form)

    def _output_on_panels(self, model: CausalLM, form: str) -> None:
        """The output layer in panels; a tied table is then kept only there, its rows read back for the
        lookup (exactly): nothing doubles."""
        if not model.spec.tie_word_embeddings:
            self._to_panels(model.lm_head, form)
            model.output_packed = model.lm_head.packed
            return
        table = model.model.embed_tokens.weight
        if table is None or (form == "float-panels" and table.dtype != torch.float32):
            return
        model.output_packed, _ = panels_product(table, None, form, self.ops)
        model.model.embed_tokens.share_packed(model.output_packed)

    def _output_on_int8(self, model: CausalLM, q: torch.Tensor, scale: torch.Tensor) -> None:
        """The output layer's product on these int8 weights: lm_head's own, or beside a tied table, which
        stays as it is for the lookup while the product reads the int8 copy."""
        int16 = self.plan.int16_activations or scale.dtype == torch.float16  # a Q8_0's scales: the AVX2 kernel
        ops = self.ops if self.plan.int8_native else None
        if not model.spec.tie_word_embeddings:
            model.lm_head.use_product(*int8_product(q, scale, None, ops, int16))
            model.output_packed = model.lm_head.packed
            return
        model.output_packed, kept = int8_product(q, scale, None, ops, int16)
        model.output_int8 = nn.Parameter(kept["packed_weight"], requires_grad=False)  # counted as the model's bytes
        model.output_int8_scale = nn.Parameter(kept["weight_scale"], requires_grad=False)
        table = model.model.embed_tokens
        if scale.dtype == torch.float16 and Q8Rows.reads(model.output_packed, table.weight):
            # The table's values are these Q8_0 blocks dequantized: look rows up there, keep no float table
            # (the embedded model's 113 MB of float32, never read from the converted folder: layer_provided).
            table.read_rows_from(Q8Rows(model.output_packed, table.weight.shape[1], self.plan.dtype))
        elif table.weight is not None and table.weight.is_meta:  # left unread, but another kernel runs the blocks
            from pagecli.models.gguf_blocks import Q8Parts, dequantize_parts

            table.weight = nn.Parameter(dequantize_parts(Q8Parts(q, scale)).to(self.plan.dtype), requires_grad=False)

    def _gguf_output(self, model: CausalLM) -> str:
        """--quantize gguf: the output layer on the file's Q8_0 blocks as they lie, as llama.cpp reads them
        (SmolLM2-135M's tied table: 30 MB instead of 113 MB of float32 a decode step); other types, or
        where Q8_0 cannot run as it lies, keep the floats: then the form the floats take (an output layer
        of the file's own in a quantized type is int8 in the plan: WeightPlan.output)."""
        from pagecli.models import gguf_blocks

        parts = self._gguf_output_parts if self._gguf_output_parts is not None else self._gguf_blocks(model).output()
        self._gguf_output_parts = None
        if isinstance(parts, gguf_blocks.Q8Parts) and self.plan.q8_0_as_is:
            self._output_on_int8(model, parts.q, parts.scale)
            return "done"
        return self.plan.floats

    # --- one Linear -----------------------------------------------------------------------------------
    def _to_panels(self, linear: Linear, form: str) -> None:
        if linear.packed is not None or linear.weight is None:
            return
        if form == "float-panels" and linear.weight.dtype != torch.float32:
            return
        linear.use_product(*panels_product(linear.weight, linear.bias, form, self.ops))

    def _quantize(self, linear: Linear, form: str) -> None:
        """int8 or int4 from the loaded floats (a Linear that keeps_floats stays as it is)."""
        if linear.packed is not None or linear.keeps_floats:
            return
        if form == "int4":
            self._on_int4(linear, *quantize_int4(linear.weight))
        else:
            self._on_int8(linear, *quantize_int8(linear.weight))

    def _on_int8(self, linear: Linear, q: torch.Tensor, scale: torch.Tensor, as_is: bool = False) -> None:
        ops = self.ops if self.plan.int8_native else None
        linear.use_product(*int8_product(q, scale, _bias(linear), ops, self.plan.int16_activations or as_is))

    def _on_int4(self, linear: Linear, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        ops = self.ops if self.plan.int4_native else None
        linear.use_product(*int4_product(q, scale, minimum, _bias(linear), ops, self.plan.int16_activations))

    # --- a GGUF file's blocks ---------------------------------------------------------------------------
    def _gguf_blocks(self, model: CausalLM) -> Any:
        """The GGUF file this model was converted from, opened once for all its layers."""
        from pagecli.models import gguf_blocks
        from pagecli.models.gguf_files import gguf_source

        if self._gguf is None:
            source = gguf_source(model.source_folder) if model.source_folder is not None else None
            if source is None:
                from pagecli.errors import PagecliError

                raise PagecliError("--quantize gguf runs a .gguf model's own quantized weights; this model was not "
                                   "loaded from a .gguf file (use int8 or int4).")
            from pagecli.models.gguf_convert import PERMUTED_ROTARY_ARCHITECTURES

            self._gguf = gguf_blocks.GgufBlocks(source, model.spec.num_heads, model.spec.num_kv_heads,
                                                model.source_folder,
                                                model.spec.model_type in PERMUTED_ROTARY_ARCHITECTURES)
        return self._gguf

    def _gguf_layer(self, model: CausalLM, index: int, layer: DecoderLayer) -> None:
        """A decoder layer's products on its GGUF blocks: Q4_0/Q4_1 on the 4-bit product, Q8_0 as it lies
        where the plan runs it so (else requantized to int8 blocks of 64: a second rounding), anything
        else left on the converted folder's floats."""
        from pagecli.models import gguf_blocks

        products = self._gguf_products.pop(index, None)
        if products is None:  # not read ahead by layer_provided: the model loaded in floats
            products = self._gguf_blocks(model).layer(index)
        for (module_name, product_name), parts in products.items():
            linear = getattr(layer.get_submodule(module_name), product_name)  # module: mlp.experts.N for an expert
            if isinstance(parts, gguf_blocks.Int4Parts):
                self._on_int4(linear, parts.q, parts.scale, parts.minimum)
            elif isinstance(parts, gguf_blocks.Q8Parts) and self.plan.q8_0_as_is:
                self._on_int8(linear, parts.q, parts.scale, as_is=True)
            elif isinstance(parts, gguf_blocks.Q8Parts):
                linear.weight = nn.Parameter(gguf_blocks.dequantize_parts(parts), requires_grad=False)
                self._quantize(linear, "int8")

    # --- the decode step --------------------------------------------------------------------------------
    def _decode_step(self, model: CausalLM) -> Any:
        """Decode-only steps run the whole layer loop in C++: the same kernels in the same order as
        CausalLM.forward, without the Python between them (a few ms per token for one stream). None where
        the plan has none (an architecture it cannot run: WeightPlan.decode_step) or a product runs in
        PyTorch (the Python loop runs it)."""
        if not self.plan.decode_step:
            return None
        layers = model.model.layers
        products = [_packed_products(layer) for layer in layers]
        if any(isinstance(p, (Int8Reference, Int4Reference)) for layer in products for p in layer):
            return None
        moe = [_moe_experts(self.ops, layer) for layer in layers]
        if any(m is False for m in moe):
            return None  # an expert's product in row layout: the Python loop runs it
        spec = model.spec
        return self.ops.DecodeStep(
            [_layer_tensors(layer) for layer in layers],
            products if any(p is not None for layer in products for p in layer) else [],
            model.model.norm.weight, model.rotary.cos, model.rotary.sin, spec.num_heads, spec.num_kv_heads,
            spec.head_dim, spec.rms_norm_eps, layers[0].self_attn.scale, self.plan.decode_team,
            moe if any(m is not None for m in moe) else [], spec.qk_norm and not spec.qk_norm_per_head,
        )


class Q8Rows:
    """The rows of a weight kept by pagecli.native's AVX2 int8 product on a GGUF file's Q8_0 blocks as they
    lie (fp16 scales per 32): q int8 [ceil(N / 16), Kp / 2, 32] in 16-row panels of k pairs (entry
    [p, kk, 2 i + j] is q[16 p + i, 2 kk + j]), scales fp16 [ceil(N / 16), Kp / 32, 16] (quant_int8.h).
    rows(ids) gives q * scale in float32, exactly the values gguf's dequantization (and so the converted
    folder) has, cast to the table's dtype."""

    def __init__(self, product: Any, in_features: int, dtype: torch.dtype) -> None:
        self.weights, self.scales = product.weights, product.scales
        self.in_features, self.dtype = in_features, dtype

    @staticmethod
    def reads(product: Any, table: torch.Tensor | None) -> bool:
        """Whether the product is the AVX2 kernel on Q8_0 blocks (the layout rows() reads) of this table's shape."""
        return (table is not None and getattr(product, "kind", None) == "avx2" and product.scales.dtype == torch.float16
                and product.weights.dim() == 3 and product.weights.shape[2] == 32
                and product.out_features == table.shape[0] and product.in_features == table.shape[1])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        panel, lane = flat // 16, flat % 16
        k = self.in_features
        q = self.weights.view(*self.weights.shape[:2], 16, 2)[panel, :, lane, :].reshape(len(flat), -1)[:, :k]
        scale = self.scales[panel, :, lane].float().repeat_interleave(32, dim=1)[:, :k]  # [n, K]
        return (q.float() * scale).to(self.dtype).view(*ids.shape, k)


def merge_into_layer(layer: DecoderLayer, pairs: dict[str, LowRank]) -> None:
    """W += B A (scaling folded into B) for each product the adapter targets, summed in float32 and rounded
    once to the weight's dtype, as PEFT's merge_and_unload does."""
    for product, pair in pairs.items():
        linear = getattr(layer.self_attn if product in ATTENTION_PRODUCTS else layer.mlp, product)
        weight = linear.weight  # [out_features, in_features]
        merged = weight.float() + pair.b.float() @ pair.a.float()
        linear.weight = nn.Parameter(merged.to(weight.dtype), requires_grad=False)


def _linears(module: nn.Module) -> list[Linear]:
    return [m for m in module.modules() if isinstance(m, Linear)]


def _bias(linear: Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _stream_weights_from_large_pages(model: CausalLM, ops: CpuOps) -> None:
    """Move the weights that products still read as they lie (AMX kernels, float32 models' and the avx2
    level's products, an unpacked output layer) into the packed weights' memory: 2 MB pages
    (pagecli/native/weight_memory.h), as decode streams them once per token. One copy at a time, each
    freed as it is replaced; the values are the same."""
    for module in _linears(model):
        if module.packed is None and module.weight is not None:
            module.weight = nn.Parameter(ops.weight_copy(module.weight.detach()), requires_grad=False)
    table = model.model.embed_tokens.weight
    if model.output_packed is None and model.spec.tie_word_embeddings and table is not None:
        model.model.embed_tokens.weight = nn.Parameter(ops.weight_copy(table.detach()), requires_grad=False)


def _layer_tensors(layer: DecoderLayer) -> list[torch.Tensor | None]:
    """One layer's tensors in the order DecodeStep takes them (decode_step.h); a packed product's weight
    is None (DecodeStep then takes its _packed_products), as are a mixture of experts' gate_up and down."""
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = attn.q_norm.weight if attn.qk_norm else None
    k_norm = attn.k_norm.weight if attn.qk_norm else None
    dense = not isinstance(mlp, SparseMoE)
    return [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, q_norm, k_norm,
            attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
            mlp.gate_up_proj.weight if dense else None, mlp.gate_up_proj.bias if dense else None,
            mlp.down_proj.weight if dense else None, mlp.down_proj.bias if dense else None]


def _packed_products(layer: DecoderLayer) -> list[Any]:
    """One layer's products (None where the weight is in row layout) in DecodeStep's order: qkv, o,
    gate_up, down (None, None for a mixture of experts: _moe_experts)."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, SparseMoE):
        return [attn.qkv_proj.packed, attn.o_proj.packed, None, None]
    return [attn.qkv_proj.packed, attn.o_proj.packed, mlp.gate_up_proj.packed, mlp.down_proj.packed]


def _moe_experts(ops: CpuOps, layer: DecoderLayer) -> Any:
    """The layer's mixture of experts for DecodeStep (pagecli.native's MoeExperts); None for a dense layer,
    False where an expert's product is not packed (or runs in PyTorch): the Python loop runs those."""
    mlp = layer.mlp
    if not isinstance(mlp, SparseMoE):
        return None
    gate_up = [expert.gate_up_proj.packed for expert in mlp.experts]
    down = [expert.down_proj.packed for expert in mlp.experts]
    native = (ops.PackedLinear, ops.F32PanelLinear, ops.PackedLinearInt8, ops.PackedLinearInt4)
    if not all(isinstance(p, native) for p in gate_up + down) or mlp.experts[0].activation != "silu":
        return False
    router = mlp.gate  # bias-free (moe.Router)
    return ops.MoeExperts(router.packed, router.weight if router.packed is None else None, gate_up, down,
                          mlp.top_k, mlp.norm_topk_prob)
