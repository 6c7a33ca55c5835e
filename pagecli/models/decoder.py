"""The lean decoder shared by Llama, Mistral, Qwen2 and Qwen3: attention runs on the paged cache.

Module names follow Hugging Face checkpoints (model.layers.N.self_attn.q_proj, ...), so
safetensors weights load by name without a mapping table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagecli import native
from pagecli.attention import AttentionBackend, AttentionMetadata
from pagecli.errors import PagecliError
from pagecli.models.layers import (
    Embedding, GatedMLP, Linear, LinearKernel, RMSNorm, RotaryEmbedding, concat_linears, linear,
)
from pagecli.models.quantize import (Int8Reference, check_quantize_device, int8_product, native_takes,
                                     quantize_int8, uses_int16_activations)
from pagecli.models.quantize_int4 import Int4Reference
from pagecli.models.spec import DecoderSpec


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = self.head_dim**-0.5
        self.q_proj = Linear(spec.hidden_size, self.num_heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = Linear(spec.hidden_size, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = Linear(spec.hidden_size, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.qkv_sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                          self.num_kv_heads * self.head_dim)

    def fuse_projections(self) -> None:
        """Replace q/k/v_proj (checkpoint names, used for loading) by one qkv_proj."""
        self.qkv_proj = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # one matmul for the three projections
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        backend.store_kv(k, v, kv_cache[0], kv_cache[1], meta)
        out = backend.forward(q, kv_cache[0], kv_cache[1], meta, self.scale)  # [num_tokens, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Holds one layer's modules; CausalLM.forward runs them (the residual adds are fused into the norms)."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    quantized_as: str | None = None  # the --quantize its Linears got (CausalLM.quantize_layer), once

    def fuse_projections(self) -> None:
        """q/k/v_proj into one qkv_proj and gate/up_proj into one gate_up_proj (the checkpoint's names
        are for loading): load_model does it as each layer's weights come in."""
        self.self_attn.fuse_projections()
        self.mlp.fuse_projections()


class DecoderBody(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole decoder. Built with checkpoint module names; load_model fuses each layer's projections."""

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderBody(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = rotary
        # --quantize gguf: layer index -> its products on the file's blocks, read before the layer loaded
        self._gguf_layer_products: dict[int, dict[tuple[str, str], Any]] = {}

    linear_kernel: LinearKernel | None = None
    decode_step: Any = None  # pagecli.native's DecodeStep over this model's weights, when set
    source_folder: Path | None = None  # the folder load_model read (a GGUF's conversion names its file)
    output_packed: Any = None  # the output layer's PackedLinear (products run packed) or int8 product (--quantize)

    def quantize_weights(self, quantize: str, ops: Any = None) -> None:
        """--quantize int8 / int4 / gguf: the decoder layers' Linears as int8 with a scale per output
        channel and 64-block (pagecli.models.quantize), as 4-bit groups (quantize_int4) or on a GGUF
        file's own blocks (gguf_blocks); with int8 and int4 the output layer as int8 too; run by
        pagecli.native's kernels (AVX2 or AVX512-VNNI, any float dtype), else by the PyTorch reference.
        The embedding table keeps the model's dtype (the lookup needs exact rows; a tied table is
        kept for it, beside the output layer's int8 copy)."""
        if quantize == "none":
            return
        int8_ops, _, exact = self._quantize_kernels(quantize, ops)
        for index in range(len(self.model.layers)):
            self.quantize_layer(index, quantize, ops)
        if quantize == "gguf":  # the output layer keeps the file's numbers
            self._gguf_output(int8_ops, exact)
        else:
            self._quantize_output(int8_ops, exact)
        self._gguf = None  # the file's blocks are all in: let the reader's mapping go

    def quantize_layer(self, index: int, quantize: str, ops: Any = None) -> None:
        """Decoder layer `index`'s Linears as quantize_weights makes them. Called as each layer loads
        (load_model's layer_ready), so a quantized model never holds all its float weights;
        quantize_weights then passes the layers already done."""
        layer = self.model.layers[index]
        if quantize == "none" or layer.quantized_as == quantize:
            return
        int8_ops, int4_ops, exact = self._quantize_kernels(quantize, ops)
        if quantize == "gguf":
            from pagecli.models import gguf_blocks

            products = self._gguf_layer_products.pop(index, None)
            if products is None:  # not read ahead by weights_on_gguf_blocks: the model loaded in floats
                products = self._gguf_blocks().layer(index)
            gguf_blocks.use_gguf_products(layer, products, int4_ops, int8_ops, exact)
        else:
            for module in layer.modules():
                if isinstance(module, Linear):
                    if quantize == "int4":
                        module.quantize_int4(int4_ops, exact)
                    else:
                        module.quantize_int8(int8_ops, exact)
        layer.quantized_as = quantize

    def float_panels_layer(self, index: int, ops: Any) -> None:
        """Decoder layer `index`'s float32 Linears on F32PanelLinear (Linear.use_float_panels: bf16 where
        that loses nothing), as use_cpu_ops puts them where native.bf16_weights_wanted; called as each
        layer loads too, so a float32 model converted from bf16 never holds all its weights in float32."""
        for module in self.model.layers[index].modules():
            if isinstance(module, Linear):
                module.use_float_panels(ops)

    def _float_panels_output(self, ops: Any) -> None:
        """The output layer on F32PanelLinear as float_panels_layer puts the others; a tied table is then
        kept only there, its rows read back for the lookup (exactly)."""
        if not self.spec.tie_word_embeddings:
            self.lm_head.use_float_panels(ops)
            self.output_packed = self.lm_head.packed
            return
        table = self.model.embed_tokens.weight
        if table is not None and table.dtype == torch.float32:
            self.output_packed = ops.F32PanelLinear(table.detach(), None)
            self.model.embed_tokens.share_packed(self.output_packed)

    def _quantize_kernels(self, quantize: str, ops: Any) -> tuple[Any, Any, bool]:
        """(the int8 kernels, the int4 kernels, whether activations round to int16) for this model's dtype:
        ops where its kernels take the dtype, else None (the PyTorch reference); refused off the CPU."""
        check_quantize_device(quantize, self.model.norm.weight.device)
        dtype = self.model.norm.weight.dtype
        int8_ops = ops if ops is not None and native_takes(ops.int8_linear_kind(), dtype) else None
        int4_ops = ops if ops is not None and native_takes(ops.int4_linear_kind(), dtype) else None
        return int8_ops, int4_ops, uses_int16_activations(dtype)

    def _quantize_output(self, ops: Any, int16_activations: bool) -> None:
        """The output layer as int8 (a scale per output channel and 64-block), as llama.cpp's quantized
        files keep theirs (Q8_0, Q6_K): in SmolLM2-135M it is 57 MB of bf16 of the 164 MB an int8 decode
        step read. A tied embedding table stays as it is for the lookup; the product reads the copy."""
        if not self.spec.tie_word_embeddings:
            self.lm_head.quantize_int8(ops, int16_activations)
            self.output_packed = self.lm_head.packed
            return
        self._output_on_int8(*quantize_int8(self.model.embed_tokens.weight), ops, int16_activations)

    def _output_on_int8(self, q: torch.Tensor, scale: torch.Tensor, ops: Any, int16_activations: bool) -> None:
        """The output layer's product on these int8 weights (quantize.int8_product): lm_head's own, or
        beside a tied table, which stays as it is for the lookup while the product reads the int8 copy."""
        if not self.spec.tie_word_embeddings:
            self.lm_head.use_int8(q, scale, ops, int16_activations)
            self.output_packed = self.lm_head.packed
            return
        self.output_packed, weights, scales = int8_product(q, scale, None, ops, int16_activations)
        self.output_int8 = nn.Parameter(weights, requires_grad=False)  # counted as the model's bytes
        self.output_int8_scale = nn.Parameter(scales, requires_grad=False)

    def _gguf_output(self, ops: Any, int16_activations: bool) -> None:
        """--quantize gguf: the output layer on the file's Q8_0 blocks as they are (gguf_blocks.runs_q8_0),
        as llama.cpp reads them (SmolLM2-135M's tied table: 30 MB instead of 113 MB of float32 a decode
        step); a tied table stays as it is for the lookup. Other types keep the converted floats."""
        from pagecli.models import gguf_blocks

        parts = self._gguf_blocks().output()
        if not isinstance(parts, gguf_blocks.Q8Parts) or not gguf_blocks.runs_q8_0(ops, int16_activations):
            return
        self._output_on_int8(parts.q, parts.scale, ops, int16_activations=True)

    _gguf: Any = None  # --quantize gguf: the file's GgufBlocks while layers are put on them

    def weights_on_gguf_blocks(self, index: int) -> frozenset[str]:
        """--quantize gguf, before decoder layer `index` loads: the checkpoint weights its GGUF blocks
        replace (load_model's layer_provided: their floats are never read); the layer's products are
        kept for quantize_layer, which puts them in place."""
        from pagecli.models import gguf_blocks

        products = self._gguf_blocks().layer(index)
        self._gguf_layer_products[index] = products
        return gguf_blocks.weights_replaced(index, products)

    def _gguf_blocks(self) -> Any:
        """--quantize gguf: the GGUF file this model was converted from, opened once for all its layers."""
        from pagecli.models import gguf_blocks

        if self._gguf is None:
            source = gguf_blocks.gguf_source(self.source_folder) if self.source_folder is not None else None
            if source is None:
                raise PagecliError("--quantize gguf runs a .gguf model's own quantized weights; this model was not "
                                   "loaded from a .gguf file (use int8 or int4).")
            self._gguf = gguf_blocks.GgufBlocks(source, self.spec.num_heads, self.spec.num_kv_heads, self.source_folder)
        return self._gguf

    def use_cpu_ops(self, ops: Any, packed: bool | None = None, quantize: str = "none",
                    bf16_weights: bool | None = None) -> None:
        """Run the elementwise steps with pagecli.native's fused CPU kernels, and bf16 products with
        its matmul (AMX tiles or AVX512-BF16 for the few rows of a decode step, where the CPU has them).

        packed (bf16 models only): every product, the output layer's included, runs on the packed
        GEMM over weights repacked here once, so a row's result has the same bits in any batch; the
        row-layout weights are dropped. A tied embedding table is then kept only packed too, its
        rows read back from the panels (nothing doubles). None: where pagecli.native.packed_gemm_wanted.

        bf16_weights (float32 models, unquantized): every product on F32PanelLinear, weights whose
        values are all bfloat16 kept in bf16 (float_panels_layer), the output layer's and a tied
        table's too. None: where pagecli.native.bf16_weights_wanted (the avx2 level)."""
        if packed is None:
            packed = native.packed_gemm_wanted(ops)
        if bf16_weights is None:
            bf16_weights = native.bf16_weights_wanted(ops)
        self.quantize_weights(quantize, ops)
        if bf16_weights and quantize == "none" and self.model.norm.weight.dtype == torch.float32:
            for index in range(len(self.model.layers)):
                self.float_panels_layer(index, ops)
            if self.output_packed is None:
                self._float_panels_output(ops)
        bf16 = self.model.norm.weight.dtype == torch.bfloat16
        packed = packed and bf16
        linear_kernel = ops.linear if bf16 else None
        self.linear_kernel = linear_kernel
        self.rotary.kernel = ops.rotary_
        for module in self.modules():
            if isinstance(module, Linear):
                module.kernel = linear_kernel
                if packed:
                    module.pack(ops)
            elif isinstance(module, RMSNorm):
                module.kernel = ops.add_rms_norm
            elif isinstance(module, GatedMLP):
                module.kernel = ops.silu_mul
        if packed and self.output_packed is None:
            if self.spec.tie_word_embeddings:
                self.output_packed = ops.PackedLinear(self.model.embed_tokens.weight.detach(), None)
                self.model.embed_tokens.share_packed(self.output_packed)
            else:
                self.output_packed = self.lm_head.packed
        self._stream_weights_from_large_pages(ops)
        # Decode-only steps run the whole layer loop in C++: the same kernels in the same order as
        # forward() below, without the Python between them (a few ms per token for one stream).
        layers = self.model.layers
        products = [self._packed_products(layer) for layer in layers]
        if any(isinstance(p, (Int8Reference, Int4Reference)) for layer in products for p in layer):
            self.decode_step = None  # products in PyTorch: the Python loop runs them
            return
        self.decode_step = ops.DecodeStep(
            [self._layer_tensors(layer) for layer in layers],
            products if any(p is not None for layer in products for p in layer) else [],
            self.model.norm.weight, self.rotary.cos, self.rotary.sin, self.spec.num_heads, self.spec.num_kv_heads,
            self.spec.head_dim, self.spec.rms_norm_eps, layers[0].self_attn.scale, native.decode_team_wanted(),
        )

    def _stream_weights_from_large_pages(self, ops: Any) -> None:
        """Move the weights that products still read as they lie (AMX kernels, float32 models' and the
        avx2 level's products, an unpacked output layer) into the packed weights' memory: 2 MB pages
        (pagecli/native/weight_memory.h), as decode streams them once per token. One copy at a time,
        each freed as it is replaced; the values are the same."""
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.packed is None and m.weight is not None]
        for module in linears:
            module.weight = nn.Parameter(ops.weight_copy(module.weight.detach()), requires_grad=False)
        if self.output_packed is None and self.spec.tie_word_embeddings and self.model.embed_tokens.weight is not None:
            table = self.model.embed_tokens.weight
            self.model.embed_tokens.weight = nn.Parameter(ops.weight_copy(table.detach()), requires_grad=False)

    @staticmethod
    def _layer_tensors(layer: DecoderLayer) -> list[torch.Tensor | None]:
        """One layer's tensors in the order DecodeStep takes them (decode_step.h); a packed product's
        weight is None (DecodeStep then takes its _packed_products)."""
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = attn.q_norm.weight if attn.qk_norm else None
        k_norm = attn.k_norm.weight if attn.qk_norm else None
        return [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, q_norm, k_norm,
                attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
                mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias]

    @staticmethod
    def _packed_products(layer: DecoderLayer) -> list[Any]:
        """One layer's packed products (PackedLinear, F32PanelLinear, PackedLinearInt8, ...; None where
        the weight is in row layout) in DecodeStep's order: qkv, o, gate_up, down."""
        attn, mlp = layer.self_attn, layer.mlp
        return [attn.qkv_proj.packed, attn.o_proj.packed, mlp.gate_up_proj.packed, mlp.down_proj.packed]

    @property
    def output_weight(self) -> torch.Tensor:
        """The output layer's row-layout weight [vocab, hidden] (None once packed: output_packed)."""
        return self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # [num_tokens, hidden], the residual stream
        # The C++ loop stands for the torch backend with the same kernels (decodes only).
        if (self.decode_step is not None and meta.num_decode_seqs == meta.num_seqs
                and getattr(backend, "cpu_ops", None) is not None and backend.native_decode(h, kv_caches)):
            return self.decode_step.forward(h, positions, kv_caches, meta.block_tables, meta.seq_lens,
                                            meta.slot_mapping)
        delta = None  # what the last attention or MLP adds to h
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer.input_layernorm.add_and_norm(h, delta)
            delta = layer.self_attn(x, positions, self.rotary, kv_cache, meta, backend)
            x = layer.post_attention_layernorm.add_and_norm(h, delta)
            delta = layer.mlp(x)
        return self.model.norm.add_and_norm(h, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output_packed is not None:
            return self.output_packed.forward(hidden)  # [num_selected, vocab]
        return linear(hidden, self.output_weight, None, self.linear_kernel)  # [num_selected, vocab]
