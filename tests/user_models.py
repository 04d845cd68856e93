"""Models the project did not write, as users bring them.

``gpt`` is nanoGPT's shape: one fused ``c_attn`` projection split by the full width
(``split(n_embd)``), views with the full head count, ``nn.Dropout(0.0)`` after each
output projection (nanoGPT's default), blocks in an ``nn.ModuleList`` inside an
``nn.ModuleDict``; ``gpt_tied`` shares the token embedding with the head;
``gpt_positions`` takes ``position_ids`` (so it can run context parallel); ``gpt_rotary``
rotates queries and keys by fp32 tables made in forward, not cast back (fp32 queries
beside half-precision values: autocast casts them for attention); ``llama_rope`` is a
Llama of one's own whose rotary tables are buffers computed in ``__init__``.
Load them as ``--model tests.user_models:gpt``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SEQ = 16
VOCAB = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(0.0)  # nanoGPT's default dropout
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(x.size())))

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int = VOCAB, n_embd: int = 64, n_head: int = 4, n_layer: int = 2,
        block_size: int = 64, tied: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, n_embd),
                "wpe": nn.Embedding(block_size, n_embd),
                "h": nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
                "ln_f": nn.LayerNorm(n_embd),
            }
        )
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        if tied:
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor]:
        device = next(self.parameters()).device
        return (torch.zeros(batch_size, SEQ, dtype=torch.long, device=device),)


class DictGPT(GPT):
    """``GPT`` returning ``{"logits": ...}`` (and the loss beside them given labels)."""

    def forward(  # type: ignore[override]
        self, idx: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        logits = super().forward(idx)
        if labels is None:
            return {"logits": logits}
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"logits": logits, "loss": loss}


def gpt_dict() -> DictGPT:
    return DictGPT()


class PositionGPT(GPT):
    """``GPT`` whose forward takes the tokens' positions, as context parallel needs."""

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(idx.size(1), device=idx.device)[None, :]
        x = self.transformer.wte(idx) + self.transformer.wpe(position_ids)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class SharedGPT(GPT):
    """``GPT`` whose blocks share one MLP input projection (ALBERT-style weight sharing)."""

    def __init__(self, n_layer: int = 3, **kwargs: Any) -> None:
        super().__init__(n_layer=n_layer, **kwargs)
        first, *others = self.transformer.h
        for block in others:
            block.mlp.c_fc.weight = first.mlp.c_fc.weight


class RotaryAttention(CausalSelfAttention):
    """Queries and keys times fp32 ``cos`` tables from an ``inv_freq`` buffer (a rotary
    embedding's dtype habits; the rotation itself does not matter here)."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__(n_embd, n_head)
        head = n_embd // n_head
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(head) / head))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        positions = torch.arange(x.size(1), device=x.device, dtype=torch.float32)
        cos = torch.outer(positions, self.inv_freq.float()).cos()
        y = F.scaled_dot_product_attention(q * cos, k * cos, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(x.size())))


class RotaryGPT(GPT):
    def __init__(self) -> None:
        super().__init__()
        for block in self.transformer.h:
            block.attn = RotaryAttention(64, 4)


class OwnLayerNorm(nn.Module):
    """nanoGPT's LayerNorm: parameters set in ``__init__``, no ``reset_parameters``."""

    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class OwnNormGPT(GPT):
    def __init__(self) -> None:
        super().__init__()
        for block in self.transformer.h:
            block.ln_1, block.ln_2 = OwnLayerNorm(64), OwnLayerNorm(64)
        self.transformer.ln_f = OwnLayerNorm(64)


def gpt() -> GPT:
    return GPT()


def gpt_own_norm() -> OwnNormGPT:
    return OwnNormGPT()


def gpt_positions() -> PositionGPT:
    return PositionGPT()


def gpt_tied() -> GPT:
    return GPT(tied=True)


def gpt_rotary() -> RotaryGPT:
    return RotaryGPT()


def regressor() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A model of features, not token ids."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, (torch.zeros(1, 8, device=next(model.parameters()).device),)


class ViewedIds(GPT):
    """Reshapes its token ids before the embedding, as Hugging Face's input_ids.view(-1, t)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx.view(-1, idx.shape[-1]))


class SegmentGPT(GPT):
    """Takes segment ids beside its token ids (a second, smaller embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.segments = nn.Embedding(2, 64)

    def forward(self, idx: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(idx) if segments is None else super().forward(idx + 0 * segments)

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(batch_size, SEQ, dtype=torch.long, device=self.lm_head.weight.device)
        return ids, torch.zeros_like(ids)


def gpt_viewed_ids() -> ViewedIds:
    return ViewedIds()


def gpt_segments() -> SegmentGPT:
    return SegmentGPT()


class BidirectionalAttention(CausalSelfAttention):
    """Every token attends to every other (an encoder): no causal mask."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(x.size())))


def _with_attention(kind: type[CausalSelfAttention]) -> GPT:
    model = GPT()
    for block in model.transformer.h:
        block.attn.__class__ = kind
    return model


def encoder() -> GPT:
    return _with_attention(BidirectionalAttention)


class MaskedAttention(CausalSelfAttention):
    """Causality in a mask tensor, as Hugging Face's eager masks: the call does not say."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(x.size())))


def masked() -> GPT:
    return _with_attention(MaskedAttention)


class RopeBlock(nn.Module):
    """Llama's block as Meta's reference writes it: separate projections, SwiGLU."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = (nn.Linear(dim, 2 * dim, bias=False) for _ in range(2))
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (
            w(h).view(b, t, self.n_head, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(
            rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True
        )
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, heads, seq, dim) by (batch, 1, seq, dim / 2) tables."""
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class RopeLlama(nn.Module):
    """A Llama of one's own: its rotary tables computed in ``__init__`` as non-persistent
    buffers (Meta's reference, torchtitan, lit-gpt), torch's ``nn.RMSNorm``,
    ``position_ids`` taken (context parallel gives each rank's global positions)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, n_head: int = 4, n_layer: int = 4,
                 max_seq: int = 64) -> None:  # fmt: skip
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(RopeBlock(dim, n_head) for _ in range(n_layer))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.output = nn.Linear(dim, vocab, bias=False)
        head = dim // n_head
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head, 2).float() / head)
        angles = torch.outer(torch.arange(max_seq).float(), inv_freq)
        self.register_buffer("freqs_cos", angles.cos(), persistent=False)
        self.register_buffer("freqs_sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(idx.size(1), device=idx.device)[None, :]
        cos, sin = self.freqs_cos[position_ids][:, None], self.freqs_sin[position_ids][:, None]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor]:
        device = self.output.weight.device
        return (torch.zeros(batch_size, SEQ, dtype=torch.long, device=device),)


def llama_rope() -> RopeLlama:
    return RopeLlama()


class MaskArgBlock(Block):
    """A block that takes its attention mask as an argument (boolean, True: attend)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        q, k, v = self.attn.heads(self.ln_1(x))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.attn.c_proj(y.transpose(1, 2).contiguous().view(x.size()))
        return x + self.mlp(self.ln_2(x))


class MaskBufferGPT(GPT):
    """Its causal mask is a boolean buffer built in ``__init__``, sliced for each block
    between the blocks (operators outside every block, between them)."""

    def __init__(self, block_size: int = 64) -> None:
        super().__init__(block_size=block_size)
        for block in self.transformer.h:
            block.__class__ = MaskArgBlock
        mask = torch.ones(block_size, block_size, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x, self.mask[:t, :t])
        return self.lm_head(self.transformer.ln_f(x))


def gpt_mask_buffer() -> MaskBufferGPT:
    return MaskBufferGPT()


def huge_embedding() -> RopeLlama:
    """A Llama with a 4 TiB embedding table: buildable on the meta device only."""
    return RopeLlama(vocab=1 << 32, dim=256)


class ComplexRopeLlama(RopeLlama):
    """``RopeLlama`` with its rotary table as one complex buffer (``torch.polar``, as
    Meta's reference builds ``freqs_cis``)."""

    def __init__(self) -> None:
        super().__init__()
        angles = torch.polar(
            torch.ones_like(self.freqs_cos), torch.atan2(self.freqs_sin, self.freqs_cos)
        )
        del self.freqs_cos, self.freqs_sin
        self.register_buffer("freqs_cis", angles, persistent=False)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(idx.size(1), device=idx.device)[None, :]
        table = self.freqs_cis[position_ids][:, None]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, table.real, table.imag)
        return self.output(self.norm(x))


def llama_complex_rope() -> ComplexRopeLlama:
    return ComplexRopeLlama()


class RoutedMLP(nn.Module):
    """Experts in an ``nn.ModuleList``, tokens gathered per expert by ``torch.where``
    (shapes that depend on the routing), a load-balancing loss kept on the module."""

    def __init__(self, n_embd: int, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(n_embd, experts, bias=False)
        self.experts = nn.ModuleList([MLP(n_embd) for _ in range(experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        weight, chosen = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            (rows,) = torch.where(chosen == index)
            out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None])
        self.aux_loss = probs.mean(0).square().sum()
        return out.view_as(x)


class StashGPT(GPT):
    """nanoGPT whose MLPs keep a tensor of their last forward as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.transformer.h:
            block.mlp.__class__ = StashMLP


class StashMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.aux_loss = out.square().mean()
        return out


def gpt_routed() -> GPT:
    model = GPT()
    for block in model.transformer.h:
        block.mlp = RoutedMLP(block.ln_2.normalized_shape[0])
    return model


def gpt_stash() -> StashGPT:
    return StashGPT()


class OwnExperts(nn.Module):
    """Grouped experts in transformers' layout, written by hand: each expert gathers its
    tokens with ``torch.where`` (shapes that depend on the routing)."""

    def __init__(self, experts: int, n_embd: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, n_embd) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(experts, n_embd, ffn) * 0.02)

    @staticmethod
    def _apply_gate(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(self.gate_up_proj.shape[0]):
            rows, slot = torch.where(top_k_index == expert)
            gate_up = F.linear(hidden[rows], self.gate_up_proj[expert])
            y = F.linear(self._apply_gate(gate_up), self.down_proj[expert])
            out = out.index_add(0, rows, y * top_k_weights[rows, slot, None])
        return out


class OwnMoE(nn.Module):
    def __init__(self, n_embd: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(n_embd, experts, bias=False)
        self.experts = OwnExperts(experts, n_embd, 2 * n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        self.aux_loss = weights.mean()  # a loss kept on the module, as some MoEs do
        return self.experts(flat, chosen, weights / weights.sum(-1, keepdim=True)).view_as(x)


def gpt_own_moe() -> GPT:
    model = GPT()
    for block in model.transformer.h:
        block.mlp = OwnMoE(block.ln_2.normalized_shape[0])
    return model
