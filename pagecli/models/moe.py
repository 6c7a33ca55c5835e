"""The mixture-of-experts MLP of Mixtral, Qwen3-MoE and OLMoE: a router picks each token's top k experts, and
each chosen expert runs once, on the group of tokens that chose it.

Grouping: the step's (token, expert) pairs are sorted by expert, so an expert's gated MLP is one product over
its group's rows, and an expert no token chose is never read (a decode token reads only its k experts'
weights). Each expert is a GatedMLP of Linears, so the weight plan puts experts in the form it gives every
decoder product (int8, int4, ...) with no branch here. The router stays in the model's floats: a rounded
router could pick other experts, and it is a small matrix (llama.cpp leaves ffn_gate_inp unquantized too).
"""

from __future__ import annotations

import torch
from torch import nn

from pagecli.models.layers import GatedMLP, Linear
from pagecli.models.spec import DecoderSpec


class Router(Linear):
    """The router: hidden -> one logit per expert (the checkpoint's `gate.weight`, [num_experts, hidden]). It
    keeps the model's floats under --quantize (keeps_floats); the float forms (panels) apply as to any Linear."""

    keeps_floats = True

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__(hidden, num_experts, bias=False)


class SparseMoE(nn.Module):
    """Router and experts of one layer. Routing: softmax over all experts (in float32), the top k, and those k
    renormalised to sum to 1 where norm_topk_prob (Mixtral always; Qwen3-MoE and OLMoE by their config)."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.gate = Router(spec.hidden_size, spec.num_experts)
        self.experts = nn.ModuleList(
            GatedMLP(spec.hidden_size, spec.moe_intermediate_size, spec.mlp_bias, spec.hidden_act)
            for _ in range(spec.num_experts))

    def fuse_projections(self) -> None:
        for expert in self.experts:
            expert.fuse_projections()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's k experts [num_tokens, top_k] and their weights (same shape, in x's dtype)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [num_tokens, num_experts]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor, lora: object = None) -> torch.Tensor:  # x: [num_tokens, hidden]
        """lora: the layer's adapter rows, as a dense MLP takes them; adapters of a mixture of experts
        target the attention only (models/lora.py refuses expert targets), so nothing is added here."""
        weights, chosen = self.route(x)
        if x.shape[0] == 1:
            return self._one_token(x, weights, chosen)
        pairs = chosen.flatten()  # [num_tokens * top_k]: pair p is token p // top_k's choice
        order = torch.argsort(pairs, stable=True)  # the pairs grouped by expert
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k  # [pairs]: each grouped pair's token
        rows = x[tokens]  # [pairs, hidden], each expert's group contiguous
        outputs = []
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                outputs.append(expert(rows[start:start + count]))  # only the chosen experts' weights are read
                start += count
        grouped = torch.cat(outputs) * weights.flatten()[order].unsqueeze(1)  # [pairs, hidden]
        return torch.zeros_like(x).index_add_(0, tokens, grouped)  # [num_tokens, hidden]

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """A lone decode token: its k experts on its one row, added in expert order as forward's index_add_
        adds them (the same bits as the token in any batch), without the grouping's sort and gathers."""
        picked = chosen[0].tolist()
        out = None
        for slot in sorted(range(self.top_k), key=picked.__getitem__):
            y = self.experts[picked[slot]](x) * weights[:, slot:slot + 1]  # [1, hidden]
            out = y if out is None else out.add_(y)
        return out
