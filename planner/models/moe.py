"""The zoo's mixture-of-experts feed-forward, in transformers' experts layout.

:class:`MoE` routes each token to ``top_k`` of ``num_experts`` gated (SwiGLU) experts
by a softmax router whose top-k weights are renormalised (Mixtral, Qwen3-MoE), and
adds ``num_shared_experts`` that every token passes through (DeepSeek). Routing is
dropless: every routed pair is computed, whatever the balance.

:class:`Experts` holds the routed experts as grouped weights exactly as transformers
does (``gate_up_proj`` ``[experts, 2 * ffn, hidden]`` with the gate rows first,
``down_proj`` ``[experts, hidden, ffn]``) and takes ``forward(hidden_states (tokens,
hidden), top_k_index, top_k_weights (tokens, top_k))``, so the planner's tracing and the
expert-parallel runtime treat zoo and Hugging Face experts alike:
:func:`expert_mlp` computes rows already sorted by expert for any such module (or its
expert-parallel shard), and :func:`expected_load_forward` is the static-shape dispatch
traced on meta (``ceil(tokens * top_k / experts)`` rows per expert: the FLOPs of any
routing, with the per-expert batch of a balanced one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Experts", "MoE", "SwiGLU", "expert_mlp", "expected_load_forward", "is_experts",
    "runs_as_transformers",
]  # fmt: skip


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds routed experts as grouped 3-D weights (zoo or transformers)."""
    weights = (getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None))
    return all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights)


def runs_as_transformers(module: nn.Module) -> bool:
    """Whether an experts module's forward is transformers' (the zoo's :class:`Experts`
    and transformers' own classes): ``forward(hidden_states, top_k_index, top_k_weights)``
    weighting each expert's SwiGLU output by its routing weight, which expert
    parallelism runs in its place. A class of one's own may compute otherwise (scale
    the tokens before the experts, as Llama 4 does)."""
    kind = type(module)
    if kind.__module__.split(".")[0] == "transformers":
        return True
    return isinstance(module, Experts) and kind.forward is Experts.forward


def expert_mlp(
    module: Any, rows: torch.Tensor, counts: Sequence[int], *, first: int = 0
) -> torch.Tensor:
    """Outputs of ``rows`` (pairs sorted by expert, ``counts[e]`` for expert
    ``first + e`` of ``module``'s grouped weights), in the same order."""
    # unbind, not one index per expert: indexing's backward writes a zero-filled gradient
    # of the whole grouped weight per expert (experts x its size), unbind's stacks one
    gate_ups, downs = module.gate_up_proj.unbind(0), module.down_proj.unbind(0)
    outputs, start = [], 0
    for local, count in enumerate(counts):
        chunk = rows[start : start + count]
        start += count
        gate_up = F.linear(chunk, gate_ups[first + local])
        outputs.append(F.linear(module._apply_gate(gate_up), downs[first + local]))
    return torch.cat(outputs) if outputs else rows[:0]


def expected_load_forward(
    self: Any,  # an experts module: gate_up_proj, down_proj, _apply_gate
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Experts forward with static shapes: ``(tokens, hidden)`` in and out."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    experts = self.gate_up_proj.shape[0]
    pairs = tokens * top_k
    slots = -(-pairs // experts)
    order = torch.argsort(top_k_index.reshape(-1))
    routed = F.pad(hidden_states[order // top_k], (0, 0, 0, experts * slots - pairs))
    dispatched = routed.view(experts, slots, hidden).transpose(1, 2)
    gate_up = torch.bmm(self.gate_up_proj, dispatched).transpose(1, 2)
    down = torch.bmm(self.down_proj, self._apply_gate(gate_up).transpose(1, 2))
    out = down.transpose(1, 2).reshape(experts * slots, hidden)[:pairs]
    weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    combined = weighted[torch.argsort(order)].view(tokens, top_k, hidden).sum(dim=1)
    return combined.to(hidden_states.dtype)


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts of width ``ffn`` as grouped weights."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` initialises its weight: U(-1/sqrt(in), 1/sqrt(in))."""
        for weight in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    @staticmethod
    def _apply_gate(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Dropless: every (token, expert) pair computed, weighted and summed per token."""
        if hidden_states.is_meta:
            return expected_load_forward(self, hidden_states, top_k_index, top_k_weights)
        tokens, hidden = hidden_states.shape
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        sorted_out = expert_mlp(self, hidden_states[order // top_k], counts)
        pair_out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
        weighted = pair_out.view(tokens, top_k, hidden) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(hidden_states.dtype)


class SwiGLU(nn.Module):
    """A bias-free gated feed-forward of width ``ffn`` (the shared experts)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Tokens (batch, seq, hidden) -> (batch, seq, hidden) through routed and shared experts."""

    def __init__(
        self, hidden: int, ffn: int, *, num_experts: int, top_k: int, num_shared: int = 0
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, ffn)
        self.shared_experts = SwiGLU(hidden, num_shared * ffn) if num_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(flat, index, weights.to(flat.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(x.shape)
