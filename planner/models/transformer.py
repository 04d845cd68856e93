"""One transformer class for the GPT, Llama and encoder families.

Written for tensor parallelism: projections are separate ``nn.Linear``s (``wq``,
``wk``, ``wv``, ``wo``; ``w1``, ``w2``, ``w3``), and attention takes its head count from
local shapes (``view(b, s, -1, head_dim)``), so column-sharding ``wq/wk/wv`` and
row-sharding ``wo`` needs no change to the code. Blocks live in an ``nn.ModuleDict``
keyed ``"0".."L-1"`` so pipeline stages can delete blocks and keep FQNs, as torchtitan
does. The model returns logits; the loss is computed outside.

Context parallel: :meth:`Transformer.shard_sequence` hands the model a
:class:`SequenceShard` (the runtime's, over the ``cp`` group). The model then sees one
contiguous shard of the sequence: positions (RoPE, position embeddings) are offset to
global ones, and attention gathers keys and values of the whole sequence, with the
causal mask shifted to the shard's queries.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from planner.spec import Activation, Family, ModelSpec

__all__ = ["Transformer", "Block", "SequenceShard"]


class SequenceShard(Protocol):
    """This rank holds shard ``index`` of ``count`` equal contiguous shards of the sequence."""

    @property
    def index(self) -> int: ...

    @property
    def count(self) -> int: ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All shards of ``x`` (batch, local seq, ...) joined on dim 1; gradients flow back."""
        ...


def global_positions(seq: int, shard: SequenceShard | None, device: torch.device) -> torch.Tensor:
    """Positions in the whole sequence of the ``seq`` local tokens (shard ``index`` of ``count``)."""
    offset = shard.index * seq if shard is not None else 0
    return torch.arange(offset, offset + seq, device=device)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary(x: torch.Tensor, theta: float, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` shaped (batch, seq, heads, head_dim) at ``positions``."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(positions.float(), inv_freq)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[None, :, None, :]
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[None, :, None, :]
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.family is not Family.LLAMA
        kv_dim = spec.kv_heads * spec.head_dim
        self.head_dim = spec.head_dim
        self.kv_groups = spec.num_heads // spec.kv_heads
        self.causal = spec.causal
        self.rope_theta = spec.rope_theta if spec.family is Family.LLAMA else None
        self.wq = nn.Linear(spec.hidden_size, spec.hidden_size, bias=bias)
        self.wk = nn.Linear(spec.hidden_size, kv_dim, bias=bias)
        self.wv = nn.Linear(spec.hidden_size, kv_dim, bias=bias)
        self.wo = nn.Linear(spec.hidden_size, spec.hidden_size, bias=bias)
        self.sequence_shard: SequenceShard | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.rope_theta is not None:
            positions = global_positions(seq, self.sequence_shard, x.device)
            q, k = rotary(q, self.rope_theta, positions), rotary(k, self.rope_theta, positions)
        if self.sequence_shard is not None:
            k, v = self.sequence_shard.gather(k), self.sequence_shard.gather(v)
        if self.kv_groups > 1:
            k = k.repeat_interleave(self.kv_groups, dim=2)
            v = v.repeat_interleave(self.kv_groups, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.sequence_shard is not None and self.causal:
            mask = self._shard_causal_mask(self.sequence_shard, seq, x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    @staticmethod
    def _shard_causal_mask(shard: SequenceShard, seq: int, device: torch.device) -> torch.Tensor:
        """(local queries, all keys) boolean mask: a query sees keys at or before its position."""
        queries = global_positions(seq, shard, device)
        keys = torch.arange(seq * shard.count, device=device)
        return keys[None, :] <= queries[:, None]


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.family is not Family.LLAMA
        self.swiglu = spec.act is Activation.SWIGLU
        self.w1 = nn.Linear(spec.hidden_size, spec.ffn_size, bias=bias)
        self.w2 = nn.Linear(spec.ffn_size, spec.hidden_size, bias=bias)
        self.w3 = nn.Linear(spec.hidden_size, spec.ffn_size, bias=bias) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.family is Family.LLAMA:
        return RMSNorm(spec.hidden_size, spec.norm_eps)
    return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = _norm(spec)
        self.attention = Attention(spec)
        self.ffn_norm = _norm(spec)
        self.feed_forward = FeedForward(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab).

    Every part is optional after construction (``None``), so a pipeline stage keeps
    only its own embedding, blocks or head.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(spec.seq_len, spec.hidden_size)
            if spec.family is not Family.LLAMA
            else None
        )
        self.layers = nn.ModuleDict({str(i): Block(spec) for i in range(spec.num_layers)})
        self.norm: nn.Module | None = _norm(spec)
        self.output: nn.Linear | None = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.sequence_shard: SequenceShard | None = None

    def shard_sequence(self, shard: SequenceShard) -> None:
        """Context parallel: inputs are from now on shard ``shard.index`` of the sequence."""
        self.sequence_shard = shard
        for module in self.modules():
            if isinstance(module, Attention):
                module.sequence_shard = shard

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(global_positions(h.shape[1], self.sequence_shard, h.device))
        for block in self.layers.values():
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
