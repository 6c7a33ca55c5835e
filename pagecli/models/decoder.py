"""The lean decoder shared by Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, Phi-3, and the mixtures of experts
Mixtral, Qwen3-MoE and OLMoE: attention runs on the paged cache. DecoderSpec's flags say where an architecture
departs from the Llama shape.

The model only: how its weights are kept and which kernels run them is pagecli.models.weight_plan's
decision, applied by weight_forms.py.

Module names follow Hugging Face checkpoints (model.layers.N.self_attn.q_proj, ...), so
safetensors weights load by name (Phi-3's checkpoint has qkv_proj and gate_up_proj already: the model is
built with those; Mixtral's expert names are the loader's one renaming, CHECKPOINT_RENAMES).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagecli.attention import AttentionBackend, AttentionMetadata
from pagecli.models.layers import (
    Embedding, GatedMLP, Linear, LinearKernel, RMSNorm, RotaryEmbedding, concat_linears, linear,
)
from pagecli.models.moe import SparseMoE
from pagecli.models.lora_batch import LayerLora, LoraBatch
from pagecli.models.spec import DecoderSpec


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = spec.attn_scale or self.head_dim**-0.5
        self.softcap = spec.attn_softcap  # scores -> softcap * tanh(scores / softcap), None: left as they are
        self.window = spec.layer_window(index)  # attends to the last `window` positions only, None: all
        self.qkv_sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                          self.num_kv_heads * self.head_dim)
        if spec.fused_checkpoint:
            self.qkv_proj = Linear(spec.hidden_size, sum(self.qkv_sizes), bias=spec.qkv_bias)
        else:
            self.q_proj = Linear(spec.hidden_size, self.num_heads * self.head_dim, bias=spec.qkv_bias)
            self.k_proj = Linear(spec.hidden_size, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
            self.v_proj = Linear(spec.hidden_size, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            # Over each head (Qwen3, Gemma 3), or over the whole projection before it is split (OLMoE).
            q_width, k_width = ((self.head_dim, self.head_dim) if spec.qk_norm_per_head else self.qkv_sizes[:2])
            self.q_norm = RMSNorm(q_width, spec.rms_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(k_width, spec.rms_norm_eps, spec.norm_offset)
        self.qk_norm = spec.qk_norm
        self.qk_norm_per_head = spec.qk_norm_per_head

    def fuse_projections(self) -> None:
        """Replace q/k/v_proj (checkpoint names, used for loading) by one qkv_proj (there already when the
        checkpoint has it)."""
        if hasattr(self, "qkv_proj"):
            return
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
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # one matmul for the three projections
        if lora is not None:
            qkv = lora.add("qkv_proj", x, qkv)
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        if self.qk_norm and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)  # [num_tokens, heads * head_dim], [num_tokens, kv_heads * head_dim]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        backend.store_kv(k, v, kv_cache[0], kv_cache[1], meta)
        if self.softcap is None and self.window is None:
            out = backend.forward(q, kv_cache[0], kv_cache[1], meta, self.scale)  # [num_tokens, heads, head_dim]
        else:
            out = backend.forward(q, kv_cache[0], kv_cache[1], meta, self.scale, softcap=self.softcap,
                                  window=self.window)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return self.o_proj(out) if lora is None else lora.add("o_proj", out, self.o_proj(out))


class DecoderLayer(nn.Module):
    """Holds one layer's modules; CausalLM.forward runs them (the residual adds are fused into the norms).
    Llama's post_attention_layernorm is the norm before the MLP; with sandwich norms (Gemma) it is the norm
    of attention's output, and pre_feedforward_layernorm / post_feedforward_layernorm surround the MLP."""

    def __init__(self, spec: DecoderSpec, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, index)
        self.mlp: GatedMLP | SparseMoE
        if spec.layer_has_experts(index):
            self.mlp = SparseMoE(spec)
        else:
            self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, spec.hidden_act,
                                fused=spec.fused_checkpoint)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)

    def fuse_projections(self) -> None:
        """q/k/v_proj into one qkv_proj and gate/up_proj into one gate_up_proj (each expert's, in a mixture of
        experts; the checkpoint's names are for loading): load_model does it as each layer's weights come in."""
        self.self_attn.fuse_projections()
        self.mlp.fuse_projections()


class DecoderBody(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, index) for index in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)


class CausalLM(nn.Module):
    """The whole decoder. Built with checkpoint module names; load_model fuses each layer's projections.
    local_rotary: the rope of sliding layers where it differs from the others' (Gemma 3), else None."""

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, local_rotary: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderBody(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = rotary
        self.local_rotary = local_rotary

    # Set by pagecli.models.weight_forms, which puts the weights in the forms of the engine's WeightPlan:
    linear_kernel: LinearKernel | None = None  # bf16 products of row-layout weights on pagecli.native's kernels
    decode_step: Any = None  # pagecli.native's DecodeStep over this model's weights
    output_packed: Any = None  # the output layer's product (panels, int8), when not a row-layout weight
    output_chooses: bool = False  # output_packed takes each row's greedy choice as it writes the logits
    source_folder: Path | None = None  # the folder load_model read (a GGUF's conversion names its file)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output layer's row-layout weight [vocab, hidden] (None once packed: output_packed)."""
        return self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary] + ([self.local_rotary] if self.local_rotary is not None else [])

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoraBatch | None = None,  # the step's adapter rows (None: every row runs the base model)
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # [num_tokens, hidden], the residual stream
        if self.spec.embed_scale is not None:
            # Gemma: sqrt(hidden_size), rounded to the model's dtype first as the reference does.
            h = h * torch.tensor(self.spec.embed_scale, dtype=torch.float32).to(h.dtype)
        if self.spec.sandwich_norms:
            return self._forward_sandwich(h, positions, kv_caches, meta, backend, lora)
        # The C++ loop stands for the torch backend with the same kernels (base-model steps of decodes or short
        # chunks: CpuAttentionBackend.one_call_rows).
        one_call_rows = getattr(backend, "one_call_rows", None)  # the compiled CPU kernels' backend has it
        # Adapter rows run there too where the CPU kernels hold the adapters (LoraBatch.native: stacks in the
        # model's dtype, float32, bf16 or fp16).
        one_call = lora is None or lora.native is not None
        rows = (one_call_rows(h, kv_caches, meta)
                if self.decode_step is not None and one_call and one_call_rows is not None else None)
        if rows is not None and lora is not None:
            native = lora.native
            return self.decode_step.forward_lora(h, positions, kv_caches, rows[0], rows[1], meta.slot_mapping,
                                                 native.stacks, native.row_slot, native.row_scale)
        if rows is not None:
            return self.decode_step.forward(h, positions, kv_caches, rows[0], rows[1], meta.slot_mapping)
        delta = None  # what the last attention or MLP adds to h
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            layer_lora = None if lora is None else LayerLora(lora, index)
            x = layer.input_layernorm.add_and_norm(h, delta)
            delta = layer.self_attn(x, positions, self.rotary, kv_cache, meta, backend, layer_lora)
            x = layer.post_attention_layernorm.add_and_norm(h, delta)
            delta = layer.mlp(x, layer_lora)
        return self.model.norm.add_and_norm(h, delta)

    def _forward_sandwich(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                          meta: AttentionMetadata, backend: AttentionBackend, lora: LoraBatch | None) -> torch.Tensor:
        """Gemma's layers: each block's output is normed before it joins the residual stream."""
        delta = None
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            layer_lora = None if lora is None else LayerLora(lora, index)
            rotary = self.local_rotary if (self.local_rotary is not None and layer.self_attn.window) else self.rotary
            x = layer.input_layernorm.add_and_norm(h, delta)
            delta = layer.post_attention_layernorm(layer.self_attn(x, positions, rotary, kv_cache, meta, backend,
                                                                   layer_lora))
            x = layer.pre_feedforward_layernorm.add_and_norm(h, delta)
            delta = layer.post_feedforward_layernorm(layer.mlp(x, layer_lora))
        return self.model.norm.add_and_norm(h, delta)

    def logits_and_greedy(self, hidden: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """compute_logits, and with greedy each row's greedy choice, int64 [num_selected] (greedy_tokens' over
        these logits), where the output product takes it as it writes the logits, tile by tile while they are
        in cache: no second pass over [num_selected, vocab]. None where it does not (the caller's pass)."""
        if greedy and self.output_chooses and hidden.dim() == 2:
            return self.output_packed.forward_choosing(hidden)  # [num_selected, vocab], [num_selected] or None
        return self.compute_logits(hidden), None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output_packed is not None:
            logits = self.output_packed.forward(hidden)  # [num_selected, vocab]
        else:
            logits = linear(hidden, self.output_weight, None, self.linear_kernel)  # [num_selected, vocab]
        if self.spec.final_softcap is not None:
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
