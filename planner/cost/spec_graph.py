"""An :class:`~planner.graph.OpGraph` built from a :class:`~planner.spec.ModelSpec` by formula.

It follows the tracer's conventions (batch 1, ``gemm`` = ``(batch, m, n, k)`` with
linears as ``(1, tokens, out, in)`` and attention as ``(heads, seq_q, seq_k,
head_dim)``, matmul backward = 2x forward, causal attention counted whole, segments
``embedding``, ``layers.<i>``, ``head``) and the zoo's module paths, so the cost model
prices it exactly as a traced graph. It needs no torch and takes microseconds, which
is why :func:`planner.cost.estimate_run` uses it for zoo-style specs.

Mixture-of-experts blocks (segment type ``moe_block``; the first ``dense_layers`` keep
type ``block``) follow :mod:`planner.models.moe` as the tracer sees it at the expected
load: the router linear (role ``router``), the routed experts as two grouped GEMMs of
``ceil(tokens * top_k / num_experts)`` rows per expert with their dispatch and weighted
combine (role ``experts``), the shared experts (role ``shared_experts``); the segment
type carries ``num_experts``, ``top_k`` and ``hidden_size``. Multi-head latent attention
follows :class:`planner.models.transformer.LatentAttention`. Tensor-core FLOPs and
parameters equal the trace's, overall and per role, and so do the experts' and shared
experts' saved bytes (tests/test_moe_models.py).

Memory-bound operators are the eager ones (RMSNorm's fp32 upcast steps, rotary as an
fp32 complex multiply, SwiGLU's silu and product); ``fused_pointwise`` in the cost
options models their fusion. What is kept for backward follows :class:`Kernels`: the
zoo's eager code by default, Transformer Engine's and Megatron-Core's where the cost
options say so. Saved-for-backward bytes follow Korthikanti et al.
(2022): a GPT block keeps ``s*b*h*34`` bytes with dropout masks (the attention scores
are added by the cost model when the attention kernel is unfused). A norm keeps its
input and its output (the next linear's input), so tensor-parallel splitting of what
it keeps follows the norm's rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.dtypes import ELEMENT_BYTES, FP32_BYTES, HALF_BYTES
from planner.graph import CROSS_ENTROPY_BYTES, OpGraph, OpKind, OpNode, OpRole, Segment, SegmentType
from planner.spec import Activation, DType, Family, ModelSpec

__all__ = ["EAGER", "Kernels", "graph_from_spec"]

_MOE_BLOCK = "moe_block"  # the segment type of blocks with experts ("block": dense ones)


@dataclass(frozen=True)
class Kernels:
    """What the training code's kernels keep for backward where frameworks differ
    (the defaults: the zoo's eager PyTorch, as traced); the fields are the
    :class:`~planner.cost.options.CostOptions` of the same names.

    ``fused_norm_swiglu``: norms and SwiGLU run as library kernels (Apex, Transformer Engine,
    Megatron-Core): a norm keeps its input and output, SwiGLU its two inputs, and no
    eager intermediate is kept. ``gqa_native``: the attention kernel
    reads keys and values at their own head count (FlashAttention 2+, Transformer
    Engine, cuDNN); eager code repeats them to every query head first.
    ``moe_probs_in_activation``: the routing probabilities multiply the experts' activation
    (Megatron-Core), so the combine keeps no expert output; transformers and the zoo
    weight the experts' outputs, which the product keeps. ``fp8_saved_inputs``: in fp8
    training a block's GEMMs keep their input for the weight gradient as the fp8 copy
    they multiplied, 1 byte (Transformer Engine's Linear, LayerNormLinear and
    GroupedLinear), where torchao's Float8Linear keeps the bf16 input; the output
    layer stays in bf16.
    """

    fused_norm_swiglu: bool = False
    gqa_native: bool = False
    moe_probs_in_activation: bool = False
    fp8_saved_inputs: bool = False


EAGER = Kernels()


class _Builder:
    """Accumulates the nodes of one segment type, chaining each to the previous one."""

    def __init__(self, element_bytes: int, tokens: int, kernels: Kernels) -> None:
        self.e = element_bytes
        self.t = tokens
        self.kernels = kernels
        # bytes per element of a GEMM's input kept for its weight gradient
        self.gemm_saved = ELEMENT_BYTES["fp8"] if kernels.fp8_saved_inputs else element_bytes
        self.nodes: list[OpNode] = []
        self.role = OpRole.NONE  # the role of the nodes added next

    def _add(self, name: str, kind: OpKind, target: str, module: str, **fields: object) -> None:
        inputs = (self.nodes[-1].name,) if self.nodes else ()
        self.nodes.append(
            OpNode(name=name, kind=kind, target=target, module=module, inputs=inputs,
                   dtype="bf16" if self.e == HALF_BYTES else "fp32", role=self.role,
                   **fields)  # type: ignore[arg-type]
        )  # fmt: skip

    def linear(self, module: str, out_f: int, in_f: int, bias: bool, saved_input: bool) -> None:
        t, e = self.t, self.e
        params = out_f * in_f + (out_f if bias else 0)
        self._add(
            module.replace(".", "_"), OpKind.MATMUL, "aten.mm", module,
            input_shapes=((1, t, in_f),), output_shape=(1, t, out_f),
            flops_fwd=2.0 * t * out_f * in_f, flops_bwd=4.0 * t * out_f * in_f,
            bytes_read=float(t * in_f * e + params * e), bytes_written=float(t * out_f * e),
            param_count=params, param_bytes=float(params * e),
            saved_bytes=float(t * in_f * self.gemm_saved) if saved_input else 0.0,
            gemm=(1, t, out_f, in_f),
        )  # fmt: skip

    def pointwise(
        self, name: str, module: str, kind: OpKind, width: int, reads: int, saved: float,
        params: int = 0, flops_per_element: float = 1.0,
    ) -> None:  # fmt: skip
        t, e = self.t, self.e
        self._add(
            name, kind, f"aten.{name}", module,
            input_shapes=tuple((1, t, width) for _ in range(reads)), output_shape=(1, t, width),
            flops_fwd=flops_per_element * t * width, flops_bwd=2 * flops_per_element * t * width,
            bytes_read=float(reads * t * width * e + params * e),
            bytes_written=float(t * width * e),
            param_count=params, param_bytes=float(params * e), saved_bytes=saved,
        )  # fmt: skip

    def chain(
        self, module: str, kind: OpKind, width: int, steps: tuple[tuple[str, float, float], ...],
        saved_per_element: float, params: int = 0,
    ) -> None:  # fmt: skip
        """Eager operators over ``tokens x width`` elements: (name, read, write) bytes each.

        The chain's saved bytes and parameters go on its last operator.
        """
        t = self.t
        for position, (name, read, write) in enumerate(steps):
            last = position == len(steps) - 1
            own = params if last else 0
            self._add(
                f"{module.replace('.', '_') or 'block'}_{name}", kind, f"aten.{name}", module,
                input_shapes=((1, t, width),), output_shape=(1, t, width),
                flops_fwd=float(t * width), flops_bwd=2.0 * t * width,
                bytes_read=read * t * width + own * self.e, bytes_written=write * t * width,
                param_count=own, param_bytes=float(own * self.e),
                saved_bytes=saved_per_element * t * width if last else 0.0,
            )  # fmt: skip

    def attention(
        self, heads: int, seq: int, head_dim: int, v_dim: int | None = None,
        kv_heads: int | None = None,
    ) -> None:  # fmt: skip
        """Scaled dot-product attention: queries and keys ``head_dim`` wide, values
        ``v_dim`` (default ``head_dim``), keys and values at ``kv_heads`` heads (default
        ``heads``), all kept for backward."""
        e, v_dim, kv_heads = self.e, v_dim or head_dim, kv_heads or heads
        qkv = seq * (heads * head_dim + kv_heads * (head_dim + v_dim)) * e
        flops = 2.0 * heads * seq * seq * (head_dim + v_dim)
        shape, v_shape = (1, heads, seq, head_dim), (1, heads, seq, v_dim)
        k_shape, kv_v_shape = (1, kv_heads, seq, head_dim), (1, kv_heads, seq, v_dim)
        self._add(
            "attention", OpKind.ATTENTION, "aten.scaled_dot_product_attention", "attention",
            input_shapes=(shape, k_shape, kv_v_shape), output_shape=v_shape,
            flops_fwd=flops, flops_bwd=2 * flops,
            bytes_read=float(qkv), bytes_written=float(seq * heads * v_dim * e),
            saved_bytes=float(qkv), gemm=(heads, seq, seq, head_dim),
        )  # fmt: skip

    def grouped(
        self, name: str, module: str, experts: int, m: int, n: int, k: int
    ) -> None:  # fmt: skip
        """One grouped GEMM as the tracer sees the expected-load dispatch: ``bmm`` of the
        ``[experts, m, k]`` weights by ``[experts, k, n]`` rows (``n`` rows per expert),
        keeping its rows for the weights' gradient."""
        e, params = self.e, experts * m * k
        flops = 2.0 * experts * m * n * k
        self._add(
            name, OpKind.MATMUL, "aten.bmm", module,
            input_shapes=((experts, m, k), (experts, k, n)), output_shape=(experts, m, n),
            flops_fwd=flops, flops_bwd=2 * flops,
            bytes_read=float((params + experts * k * n) * e),
            bytes_written=float(experts * m * n * e), param_count=params,
            param_bytes=float(params * e), saved_bytes=float(experts * k * n * self.gemm_saved),
            gemm=(experts, m, n, k),
        )  # fmt: skip

    def rows(
        self, name: str, module: str, kind: OpKind, shape: tuple[int, ...], read: float,
        saved: float = 0.0,
    ) -> None:  # fmt: skip
        """A memory-bound operator writing ``shape`` (bytes ``read``, ``saved`` kept)."""
        elements = math.prod(shape)
        self._add(
            name, kind, f"aten.{name}", module, input_shapes=(shape,), output_shape=shape,
            flops_fwd=float(elements), flops_bwd=2.0 * elements, bytes_read=read,
            bytes_written=float(elements * self.e), saved_bytes=saved,
        )  # fmt: skip


# Eager operator sequences as (name, bytes read, bytes written) per element, for 2-byte
# activations. RMSNorm follows planner.models.transformer (fp32 upcast); rotary is the
# fp32 complex multiply of torchtitan/Llama (the zoo's cat-based form moves more bytes).
_RMSNORM = (
    ("to_fp32", HALF_BYTES, FP32_BYTES), ("pow", FP32_BYTES, FP32_BYTES), ("mean", FP32_BYTES, 0),
    ("mul_rsqrt", FP32_BYTES, FP32_BYTES), ("to_bf16", FP32_BYTES, HALF_BYTES),
    ("mul_weight", HALF_BYTES, HALF_BYTES),
)  # fmt: skip
_ROTARY = (
    ("to_fp32", HALF_BYTES, FP32_BYTES), ("complex_mul", FP32_BYTES, FP32_BYTES),
    ("to_bf16", FP32_BYTES, HALF_BYTES),
)  # fmt: skip


def _norm(b: _Builder, module: str, spec: ModelSpec, h: int, params: int | None = None) -> None:
    """A norm over ``h`` features a token (``params`` weights, default ``h``: fewer for
    per-head norms). LayerNorm, and RMSNorm with fused kernels, is one kernel keeping
    input and output (Korthikanti: 2+2 bytes per element; the output as the next GEMM
    keeps it, :class:`Kernels`); eager RMSNorm (the zoo's) keeps its one fp32 upcast (in
    fp32, the input itself), its normalised value and output (4+2+2, fp32 4+4+4)."""
    scale = b.e / HALF_BYTES
    if spec.family is Family.LLAMA:
        steps = tuple((n, r * scale, w * scale) for n, r, w in _RMSNORM)
        # input and output; eager also the fp32 upcast and the normalised value
        fused = b.e + b.gemm_saved
        kept = fused if b.kernels.fused_norm_swiglu else FP32_BYTES + 2 * b.e
        weights = h if params is None else params
        b.chain(module, OpKind.NORM, h, steps, saved_per_element=kept, params=weights)
    else:
        b.chain(module, OpKind.NORM, h, (("layer_norm", b.e, b.e),), 2.0 * b.e, params=2 * h)


def _residual(b: _Builder, name: str, h: int, dropout: bool) -> None:
    b.pointwise(name, "", OpKind.ELEMENTWISE, h, 2, saved=float(b.t * h) if dropout else 0.0)


def _attention(b: _Builder, spec: ModelSpec, seq: int) -> None:
    """Multi-head attention with grouped queries (Megatron-LM's layout)."""
    e, h, bias = b.e, spec.hidden_size, spec.family is not Family.LLAMA
    q, kv = spec.num_heads * spec.head_size, spec.kv_heads * spec.head_size
    b.linear("attention.wq", q, h, bias, saved_input=False)
    b.linear("attention.wk", kv, h, bias, saved_input=False)
    b.linear("attention.wv", kv, h, bias, saved_input=False)
    if spec.qk_norm:  # per-head RMSNorms of queries and keys (Qwen3)
        _norm(b, "attention.q_norm", spec, q, params=spec.head_size)
        _norm(b, "attention.k_norm", spec, kv, params=spec.head_size)
    if spec.family is Family.LLAMA:
        _rotary(b, q + kv)
    if kv < q and b.kernels.gqa_native:  # grouped-query attention read at kv heads
        b.attention(spec.num_heads, seq, spec.head_size, kv_heads=spec.kv_heads)
    else:
        if kv < q:  # grouped-query attention: K and V repeated to every query head
            b.chain("attention", OpKind.ELEMENTWISE, 2 * q, (("repeat_kv", e * kv / q, e),), 0.0)
        b.attention(spec.num_heads, seq, spec.head_size)
    b.chain("attention", OpKind.ELEMENTWISE, q, (("merge_heads", e, e),), 0.0)
    b.linear("attention.wo", h, q, bias, saved_input=True)


def _rotary(b: _Builder, width: int) -> None:
    steps = tuple((n, r * b.e / HALF_BYTES, w * b.e / HALF_BYTES) for n, r, w in _ROTARY)
    b.chain("attention", OpKind.ELEMENTWISE, width, steps, saved_per_element=0.0)


def _latent_attention(b: _Builder, spec: ModelSpec, seq: int) -> None:
    """DeepSeek-V3's multi-head latent attention (planner.models.transformer.LatentAttention)."""
    e, h, heads = b.e, spec.hidden_size, spec.num_heads
    nope, rope = spec.qk_nope_head_dim or 0, spec.qk_rope_head_dim or 0
    v_dim, kv_rank, qk = spec.v_head_dim or 0, spec.kv_lora_rank or 0, nope + rope
    if spec.q_lora_rank is None:
        b.role = OpRole.LATENT_UP  # Megatron projects queries from the hidden state there
        b.linear("attention.wq", heads * qk, h, False, saved_input=False)
    else:
        b.linear("attention.wq_a", spec.q_lora_rank, h, False, saved_input=False)
        b.role = OpRole.LATENT_UP
        _norm(b, "attention.q_norm", spec, spec.q_lora_rank)
        b.linear("attention.wq_b", heads * qk, spec.q_lora_rank, False, saved_input=False)
    b.role = OpRole.NONE
    b.linear("attention.wkv_a", kv_rank + rope, h, False, saved_input=False)
    b.role = OpRole.LATENT_UP
    _rotary(b, (heads + 1) * rope)  # every query head's rotary part and the shared key's
    _norm(b, "attention.kv_norm", spec, kv_rank)
    b.linear("attention.wkv_b", heads * (nope + v_dim), kv_rank, False, saved_input=False)
    # queries and keys: no-position and rotary parts joined (the shared key to every head)
    b.chain("attention", OpKind.ELEMENTWISE, 2 * heads * qk, (("cat_qk", e, e),), 0.0)
    b.role = OpRole.NONE
    b.attention(heads, seq, qk, v_dim)
    b.chain("attention", OpKind.ELEMENTWISE, heads * v_dim, (("merge_heads", e, e),), 0.0)
    b.linear("attention.wo", h, heads * v_dim, False, saved_input=True)


def _feed_forward(b: _Builder, spec: ModelSpec, module: str, f: int, bias: bool) -> None:
    """A dense feed-forward of width ``f`` at ``module`` (SwiGLU or GELU)."""
    e, h = b.e, spec.hidden_size
    b.linear(f"{module}.w1", f, h, bias, saved_input=False)
    if spec.act is Activation.SWIGLU:
        b.linear(f"{module}.w3", f, h, bias, saved_input=False)
        # silu keeps w1's output, the product silu's and w3's (fused: only w3's)
        b.chain(module, OpKind.ELEMENTWISE, f, (("silu", e, e),), saved_per_element=e)
        product_kept = e if b.kernels.fused_norm_swiglu else 2 * e
        b.chain(module, OpKind.ELEMENTWISE, f, (("mul", 2 * e, e),), saved_per_element=product_kept)
    else:
        b.pointwise("gelu", module, OpKind.ELEMENTWISE, f, 1, saved=float(b.t * f * e))
    b.linear(f"{module}.w2", h, f, bias, saved_input=True)


def _moe(b: _Builder, spec: ModelSpec) -> None:
    """The zoo's MoE (planner.models.moe) as traced at the expected load: router, softmax
    and top-k, the routed pairs sorted into ``num_experts`` slots of
    ``ceil(tokens * top_k / num_experts)`` rows, two grouped GEMMs, the weighted combine,
    then the shared experts."""
    e, t, h, f = b.e, b.t, spec.hidden_size, spec.expert_ffn_size
    experts, pairs = spec.num_experts, b.t * spec.top_k
    slots = -(-pairs // experts)
    b.role = OpRole.ROUTER
    b.linear("feed_forward.router", experts, h, False, saved_input=False)
    b.role = OpRole.NONE
    steps = (("softmax", e + 2 * FP32_BYTES, 2 * FP32_BYTES),)  # fp32 probabilities, kept
    b.chain("feed_forward", OpKind.SOFTMAX, experts, steps, saved_per_element=float(FP32_BYTES))
    b.role = OpRole.EXPERTS
    module, rows = "feed_forward.experts", experts * slots
    b.rows("dispatch", module, OpKind.ELEMENTWISE, (rows, h), read=float(pairs * h * e))
    b.grouped("experts_gate_up", module, experts, 2 * f, slots, h)
    gate = float(rows * f * e)
    b.rows("silu", module, OpKind.ELEMENTWISE, (experts, slots, f), read=gate, saved=gate)
    probs = float(pairs * e) if b.kernels.moe_probs_in_activation else 0.0  # kept with the product
    # as the dense SwiGLU: the product keeps silu's output and the up half (fused: the up half)
    product = gate if b.kernels.fused_norm_swiglu else 2 * gate
    b.rows(
        "mul", module, OpKind.ELEMENTWISE, (experts, slots, f), read=2 * gate,
        saved=product + probs,
    )  # fmt: skip
    b.grouped("experts_down", module, experts, h, slots, f)
    weighted = float(pairs * h * e + pairs * e)  # expert outputs and routing weights
    # the combine keeps what it weights, unless the probabilities were applied already
    kept = 0.0 if b.kernels.moe_probs_in_activation else weighted
    b.rows("combine_mul", module, OpKind.ELEMENTWISE, (pairs, h), weighted, saved=kept)
    b.rows("combine_sum", module, OpKind.REDUCTION, (t, h), read=float(pairs * h * e))
    if spec.num_shared_experts:
        b.role = OpRole.SHARED_EXPERTS
        _feed_forward(b, spec, "feed_forward.shared_experts", spec.num_shared_experts * f, False)
        b.role = OpRole.NONE
        b.pointwise("shared_add", "feed_forward", OpKind.ELEMENTWISE, h, 2, saved=0.0)
    b.role = OpRole.NONE


def _block(
    spec: ModelSpec, seq: int, e: int, dropout: bool, kernels: Kernels, *, moe: bool
) -> SegmentType:
    b = _Builder(e, seq, kernels)
    h, bias = spec.hidden_size, spec.family is not Family.LLAMA
    _norm(b, "attention_norm", spec, h)
    if spec.latent_attention:
        _latent_attention(b, spec, seq)
    else:
        _attention(b, spec, seq)
    _residual(b, "attention_residual", h, dropout)
    _norm(b, "ffn_norm", spec, h)
    if not moe:
        _feed_forward(b, spec, "feed_forward", spec.ffn_size, bias)
        _residual(b, "ffn_residual", h, dropout)
        return SegmentType(type_id="block", kind="block", nodes=tuple(b.nodes))
    _moe(b, spec)
    _residual(b, "ffn_residual", h, dropout)
    return SegmentType(
        type_id=_MOE_BLOCK, kind="block", nodes=tuple(b.nodes), num_experts=spec.num_experts,
        top_k=spec.top_k, hidden_size=h,
    )  # fmt: skip


def _embedding(spec: ModelSpec, seq: int, e: int, dropout: bool) -> SegmentType:
    b = _Builder(e, seq, EAGER)
    h, v = spec.hidden_size, spec.vocab_size
    b.pointwise("tok_embeddings", "tok_embeddings", OpKind.EMBEDDING, h, 0,
                saved=float(seq * ELEMENT_BYTES["int64"]), params=v * h,
                flops_per_element=0.0)  # fmt: skip
    if spec.family is not Family.LLAMA:
        b.pointwise("pos_embeddings", "pos_embeddings", OpKind.ELEMENTWISE, h, 1,
                    saved=float(seq * h) if dropout else 0.0, params=seq * h)  # fmt: skip
    return SegmentType(type_id="embedding", kind="embedding", nodes=tuple(b.nodes))


def _head(spec: ModelSpec, seq: int, e: int, kernels: Kernels) -> SegmentType:
    b = _Builder(e, seq, replace(kernels, fp8_saved_inputs=False))  # the output layer: bf16
    h, v = spec.hidden_size, spec.vocab_size
    _norm(b, "norm", spec, h)
    b.linear("output", v, h, bias=False, saved_input=False)
    if spec.tied_embeddings:  # the weight belongs to tok_embeddings
        last = b.nodes[-1]
        b.nodes[-1] = OpNode(**{**last.__dict__, "param_count": 0, "param_bytes": 0.0})
    # logits.float() (a copy below fp32), then log_softmax (its fp32 output kept for
    # backward) and nll_loss
    read, written = CROSS_ENTROPY_BYTES
    cast = (e, FP32_BYTES) if e != FP32_BYTES else (0, 0)
    steps = (("cross_entropy", cast[0] + read, cast[1] + written),)
    b.chain("loss", OpKind.LOSS, v, steps, saved_per_element=float(FP32_BYTES))
    return SegmentType(type_id="head", kind="head", nodes=tuple(b.nodes))


def graph_from_spec(
    spec: ModelSpec, *, seq_len: int | None = None, dtype: DType = DType.BF16,
    dropout: bool = False, kernels: Kernels = EAGER,
) -> OpGraph:  # fmt: skip
    """The operator graph of ``spec`` for one sequence of ``seq_len`` tokens (batch 1),
    keeping for backward what ``kernels`` keep."""
    seq = seq_len or spec.seq_len
    e = dtype.activation_bytes
    if dtype is not DType.FP8:
        kernels = replace(kernels, fp8_saved_inputs=False)
    layer_types = [_MOE_BLOCK if spec.is_moe_layer(i) else "block" for i in range(spec.num_layers)]
    types = {"embedding": _embedding(spec, seq, e, dropout)}
    for type_id in dict.fromkeys(layer_types):
        types[type_id] = _block(spec, seq, e, dropout, kernels, moe=type_id == _MOE_BLOCK)
    types["head"] = _head(spec, seq, e, kernels)
    modules_in = ("tok_embeddings",) + (() if spec.family is Family.LLAMA else ("pos_embeddings",))
    segments = (
        Segment("embedding", "embedding", modules_in),
        *(Segment(f"layers.{i}", t, (f"layers.{i}",)) for i, t in enumerate(layer_types)),
        Segment("head", "head", ("norm", "output")),
    )
    return OpGraph(model_name=spec.name, batch_size=1, seq_len=seq, dtype=dtype.value,
                   tracer="formula", segments=segments, types=types)  # fmt: skip
