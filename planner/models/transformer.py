"""One transformer class for the GPT, Llama and encoder families.

Written for tensor parallelism: projections are separate ``nn.Linear``s (``wq``,
``wk``, ``wv``, ``wo``; ``w1``, ``w2``, ``w3``), and attention takes its head count from
local shapes (``view(b, s, -1, head_dim)``), so column-sharding ``wq/wk/wv`` and
row-sharding ``wo`` needs no change to the code. Blocks live in an ``nn.ModuleDict``
keyed ``"0".."L-1"`` so pipeline stages can delete blocks and keep FQNs, as torchtitan
does. The model returns logits; the loss is computed outside.

Multi-head latent attention (DeepSeek-V2/V3) is :class:`LatentAttention`, mixture-of-experts
feed-forwards :class:`~planner.models.moe.MoE`.

``forward(tokens, position_ids=None)`` takes the tokens' positions (RoPE, position
embeddings) as Hugging Face models do, so context parallel can hand a sequence shard its
global positions (:mod:`strategies.context_parallel`); attention is plain
``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.moe import MoE
from planner.spec import Activation, Family, ModelSpec

__all__ = ["Transformer", "Block", "LatentAttention", "LayerNorm"]


def _positions(position_ids: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``position_ids`` (batch or 1, seq), or ``0..seq-1`` for the tokens of ``x`` (batch, seq, ...)."""
    if position_ids is not None:
        return position_ids
    return torch.arange(x.shape[1], device=x.device)[None, :]


def autocast_dtype() -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes in where it is on (CUDA or CPU), else ``None``."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 from one upcast of its input (its square and its product
    share it); the output is in the input's dtype, or autocast's where it is on, so the
    projections reading it share one half-precision copy (an fp32 output would be cast,
    and saved for backward, once per projection)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        upcast = x.float()
        normed = upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + self.eps)
        dtype = autocast_dtype()
        if dtype is None:
            return normed.type_as(x) * self.weight
        return normed.to(dtype) * self.weight.to(dtype)


def rotary(x: torch.Tensor, theta: float, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, seq, heads, head_dim) at ``positions``
    (batch or 1, seq)."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim
    )
    angles = positions.float()[..., None] * inv_freq
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[:, :, None, :]
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[:, :, None, :]
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.family is not Family.LLAMA
        h, self.head_dim = spec.hidden_size, spec.head_size
        q_dim, kv_dim = spec.num_heads * self.head_dim, spec.kv_heads * self.head_dim
        self.kv_groups = spec.num_heads // spec.kv_heads
        self.causal = spec.causal
        self.rope_theta = spec.rope_theta if spec.family is Family.LLAMA else None
        self.wq = nn.Linear(h, q_dim, bias=bias)
        self.wk = nn.Linear(h, kv_dim, bias=bias)
        self.wv = nn.Linear(h, kv_dim, bias=bias)
        self.wo = nn.Linear(q_dim, h, bias=bias)
        # Qwen3: every query and key head normalised before rotary
        self.q_norm = RMSNorm(self.head_dim, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.norm_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            positions = _positions(position_ids, x)
            q, k = rotary(q, self.rope_theta, positions), rotary(k, self.rope_theta, positions)
        if self.kv_groups > 1:
            k = k.repeat_interleave(self.kv_groups, dim=2)
            v = v.repeat_interleave(self.kv_groups, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class LatentAttention(nn.Module):
    """Multi-head latent attention in DeepSeek-V3's layout (:meth:`ModelSpec.num_params`
    counts it): queries through a ``q_lora_rank`` latent (``wq_a``, ``q_norm``, ``wq_b``)
    or directly (``wq``); keys and values from one ``kv_lora_rank`` latent (``wkv_a`` also
    yields a rotary key of ``qk_rope_head_dim`` shared by every head; ``kv_norm``,
    ``wkv_b``); ``wo`` back to the hidden size. Heads come from local shapes, so
    column-sharding ``wq_b``/``wq``/``wkv_b`` and row-sharding ``wo`` is tensor parallel."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, heads = spec.hidden_size, spec.num_heads
        self.nope = spec.qk_nope_head_dim or 0
        self.rope = spec.qk_rope_head_dim or 0
        self.v_dim = spec.v_head_dim or 0
        self.kv_rank = spec.kv_lora_rank or 0
        self.causal = spec.causal
        self.rope_theta = spec.rope_theta
        q_dim = heads * (self.nope + self.rope)
        if spec.q_lora_rank is None:
            self.wq: nn.Linear | None = nn.Linear(h, q_dim, bias=False)
        else:
            self.wq = None
            self.wq_a = nn.Linear(h, spec.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(spec.q_lora_rank, spec.norm_eps)
            self.wq_b = nn.Linear(spec.q_lora_rank, q_dim, bias=False)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, spec.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, h, bias=False)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.wq is not None:
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        positions = _positions(position_ids, x)
        q = self._queries(x).view(bsz, seq, -1, self.nope + self.rope)
        q_nope, q_rope = torch.split(q, [self.nope, self.rope], dim=-1)
        q_rope = rotary(q_rope, self.rope_theta, positions)
        latent, k_rope = torch.split(self.wkv_a(x), [self.kv_rank, self.rope], dim=-1)
        k_rope = rotary(k_rope.unsqueeze(2), self.rope_theta, positions)  # one head, shared
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seq, -1, self.nope + self.v_dim)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)
        k = torch.cat((k_nope, k_rope.expand_as(q_rope)), dim=-1).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), is_causal=self.causal,
            scale=1.0 / math.sqrt(self.nope + self.rope),
        )  # fmt: skip
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


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


class LayerNorm(nn.LayerNorm):
    """LayerNorm in autocast's dtype where it is on (MosaicML's low-precision LayerNorm):
    CUDA's autocast runs ``layer_norm`` in fp32 and returns fp32, which every projection
    reading it would cast, and save for backward, again; this keeps one half-precision
    input and output, as without autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype()
        if dtype is None:
            return super().forward(x)
        weight = self.weight.to(dtype) if self.weight is not None else None
        bias = self.bias.to(dtype) if self.bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x.to(dtype), self.normalized_shape, weight, bias, self.eps)


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.family is Family.LLAMA:
        return RMSNorm(spec.hidden_size, spec.norm_eps)
    return LayerNorm(spec.hidden_size, eps=spec.norm_eps)


def _feed_forward(spec: ModelSpec, index: int) -> nn.Module:
    if not spec.is_moe_layer(index):
        return FeedForward(spec)
    return MoE(
        spec.hidden_size, spec.expert_ffn_size, num_experts=spec.num_experts,
        top_k=spec.top_k, num_shared=spec.num_shared_experts,
    )  # fmt: skip


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``
    (block ``index``'s feed-forward is a :class:`~planner.models.moe.MoE` when the spec
    gives it experts)."""

    def __init__(self, spec: ModelSpec, index: int = 0) -> None:
        super().__init__()
        self.attention_norm = _norm(spec)
        self.attention = LatentAttention(spec) if spec.latent_attention else Attention(spec)
        self.ffn_norm = _norm(spec)
        self.feed_forward = _feed_forward(spec, index)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), position_ids)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab).

    ``position_ids`` (batch or 1, seq) are the tokens' positions, ``0..seq-1`` when not
    given. Under autocast the hidden state between blocks is in autocast's dtype, so
    fp32 weights under autocast keep (and a pipeline sends) what half-precision weights
    do, which is what the cost model prices.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(spec.seq_len, spec.hidden_size)
            if spec.family is not Family.LLAMA
            else None
        )
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.num_layers)})
        self.norm = _norm(spec)
        self.output = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(_positions(position_ids, h))
        dtype = autocast_dtype()
        if dtype is not None:  # the residual stream in autocast's dtype, as with half weights
            h = h.to(dtype)
        for block in self.layers.values():  # without positions, traced as block(h) alone
            h = block(h) if position_ids is None else block(h, position_ids)
        return self.output(self.norm(h))
