"""Typed documents the planner reads and writes (pydantic v2).

Inputs: :class:`ModelSpec` (a transformer preset), :class:`Cluster`, :class:`Training`,
:class:`Strategy`. Output: :class:`Plan`. Every document is frozen, rejects unknown
fields, carries ``schema_version`` and round-trips through JSON. Units are in field
names: ``_GBps`` is 10^9 bytes per second in one direction per GPU, ``_us``
microseconds, ``_s`` seconds, ``_bytes`` bytes, ``_gib`` 2^30 bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from planner.dtypes import FP32_BYTES, HALF_BYTES
from planner.errors import SpecError
from planner.io import document_json, parse_json, read_json

__all__ = [
    "SCHEMA_VERSION",
    "Axis",
    "Family",
    "Activation",
    "DType",
    "Optimizer",
    "RecomputeMode",
    "Schedule",
    "CompressionKind",
    "TPStyle",
    "ModuleTP",
    "ModelSpec",
    "LinkTier",
    "Cluster",
    "Training",
    "Compression",
    "Strategy",
    "MeshAxis",
    "communication_s",
    "compute_s",
    "ErrorBand",
    "MemoryBand",
    "ErrorBandTable",
    "Prediction",
    "Candidate",
    "SolverStats",
    "TracedInput",
    "Plan",
    "load_document",
    "load_model_spec",
    "format_validation_error",
    "Limit",
    "Floor",
    "MAX_LAYERS",
    "MAX_HIDDEN",
    "MAX_HEADS",
    "MAX_FFN",
    "MAX_VOCAB",
    "MAX_SEQ",
    "MAX_BATCH",
    "MAX_GPUS",
    "MAX_GPUS_PER_NODE",
    "MAX_VIRTUAL_STAGES",
]

SCHEMA_VERSION: Literal[1] = 1
PositiveInt = Annotated[int, Field(ge=1)]


# ----- bounds on absurd values ---------------------------------------------------------------
# Generous limits that no real use reaches: each keeps the search, the cost model and the
# runtime in seconds and in range (the search enumerates divisors of the batch and of the
# GPU count; the stage DP is quadratic in the layers). A value past one is refused with the
# limit and why, as "num_layers = 100000 > 10000: ...".


@dataclass(frozen=True)
class Limit:
    """The largest value a number may take (inclusive), and why; a pydantic
    ``AfterValidator`` and the check of the matching command-line option."""

    most: int | float
    why: str

    def __call__(self, value: Any) -> Any:
        if value > self.most:
            raise ValueError(f"> {_number(self.most)}: {self.why}")
        return value


@dataclass(frozen=True)
class Floor:
    """The smallest value a positive number may take (inclusive), and why."""

    least: float
    why: str

    def __call__(self, value: Any) -> Any:
        if value < self.least:
            raise ValueError(f"< {_number(self.least)}: {self.why}")
        return value


def _number(value: float) -> str:
    """``10000``, ``1e-06``: integers in full, other numbers short."""
    if isinstance(value, int) or (value.is_integer() and abs(value) < 1e16):
        return str(int(value))
    return f"{value:g}"


_SECONDS = "this bound keeps planning in seconds"
MAX_LAYERS = Limit(1000, f"no published model has more than ~200 layers; {_SECONDS}")
MAX_HIDDEN = Limit(1_048_576, "published models are at most ~25,600 wide (hidden size)")
MAX_HEADS = Limit(65_536, "published models have at most ~128 attention heads")
MAX_FFN = Limit(4_194_304, "published feed-forward layers are at most ~75,000 wide")
MAX_VOCAB = Limit(16_777_216, "published vocabularies have at most ~260,000 tokens")
MAX_SEQ = Limit(10_000_000, "the longest published contexts are ~10 million tokens")
MAX_BATCH = Limit(
    100_000_000, f"the largest published runs take a few thousand sequences per step; {_SECONDS}"
)
MAX_GPUS = Limit(1_048_576, f"the largest clusters have ~100,000 GPUs; {_SECONDS}")
MAX_GPUS_PER_NODE = Limit(4096, "the largest scale-up (NVLink) domains have 576 GPUs")
MAX_VIRTUAL_STAGES = Limit(
    MAX_LAYERS.most, "a pipeline rank cannot hold more model chunks than a model has layers"
)
_MAX_RANK = Limit(1_048_576, "a PowerSGD rank above the hidden size compresses nothing")
MAX_EXPERTS = Limit(65_536, "published mixture-of-experts models have at most ~256 routed experts")


def _maximum(limit: Limit) -> Any:
    return Field(json_schema_extra={"maximum": limit.most})


Layers = Annotated[int, Field(ge=1), _maximum(MAX_LAYERS), AfterValidator(MAX_LAYERS)]
Hidden = Annotated[int, Field(ge=1), _maximum(MAX_HIDDEN), AfterValidator(MAX_HIDDEN)]
Heads = Annotated[int, Field(ge=1), _maximum(MAX_HEADS), AfterValidator(MAX_HEADS)]
FfnSize = Annotated[int, Field(ge=1), _maximum(MAX_FFN), AfterValidator(MAX_FFN)]
Vocab = Annotated[int, Field(ge=1), _maximum(MAX_VOCAB), AfterValidator(MAX_VOCAB)]
SeqLen = Annotated[int, Field(ge=1), _maximum(MAX_SEQ), AfterValidator(MAX_SEQ)]
BatchSize = Annotated[int, Field(ge=1), _maximum(MAX_BATCH), AfterValidator(MAX_BATCH)]
GpuCount = Annotated[int, Field(ge=1), _maximum(MAX_GPUS), AfterValidator(MAX_GPUS)]
NodeSize = Annotated[
    int, Field(ge=1), _maximum(MAX_GPUS_PER_NODE), AfterValidator(MAX_GPUS_PER_NODE)
]
ChunkCount = Annotated[
    int, Field(ge=1), _maximum(MAX_VIRTUAL_STAGES), AfterValidator(MAX_VIRTUAL_STAGES)
]
Rank = Annotated[int, Field(ge=1), _maximum(_MAX_RANK), AfterValidator(_MAX_RANK)]
Experts = Annotated[int, Field(ge=0), _maximum(MAX_EXPERTS), AfterValidator(MAX_EXPERTS)]
# Rates and sizes of links: positive, and in a range whose products and quotients stay
# finite (a bandwidth of 1e-320 GB/s would make an infinite step time).
_RATE_FLOOR = Floor(1e-6, "must be positive (1e-06 is 1 kB/s, slower than any link)")
_RATE_LIMIT = Limit(1e9, "faster than any link or memory (1e9 GB/s is an exabyte per second)")
_DELAY_LIMIT = Limit(1e9, "more than 1000 s: no link or kernel is that slow")
Bandwidth = Annotated[float, AfterValidator(_RATE_FLOOR), AfterValidator(_RATE_LIMIT)]
Latency = Annotated[float, Field(ge=0), AfterValidator(_DELAY_LIMIT)]


class Axis(StrEnum):
    """Device-mesh axis names ("axis" is a mesh axis; "dim" is a tensor dimension)."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"


# The mesh's axes from outermost to innermost: tensor parallelism, which talks the most,
# is innermost (adjacent GPUs); the data axes are tp * cp GPUs apart.
MESH_ORDER = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP)


class Family(StrEnum):
    GPT = "gpt"
    LLAMA = "llama"
    ENCODER = "encoder"


class Activation(StrEnum):
    GELU = "gelu"
    SWIGLU = "swiglu"


class DType(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"  # fp8 matmuls, bf16 everything else (as torchao Float8 training)

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation (and parameter) element: fp8 training keeps bf16 ones."""
        return FP32_BYTES if self is DType.FP32 else HALF_BYTES


class Optimizer(StrEnum):
    ADAM = "adam"
    ADAMW = "adamw"
    SGD = "sgd"

    @property
    def state_bytes_per_param(self) -> int:
        """fp32 optimizer state bytes per parameter (Adam: two moments; SGD: momentum)."""
        return 4 if self is Optimizer.SGD else 8


class RecomputeMode(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # attention core recomputed (Korthikanti et al. 2022)
    FULL = "full"  # whole block recomputed, only its input is kept


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZERO_BUBBLE = "zero-bubble"


class CompressionKind(StrEnum):
    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    POWERSGD = "powersgd"
    LOCAL_SGD = "local_sgd"
    INT8 = "int8"

    @property
    def lossy(self) -> bool:
        """Whether the option changes the gradients the optimizer sees (all but none)."""
        return self is not CompressionKind.NONE

    @property
    def half(self) -> bool:
        """Whether gradients are reduced in a 2-byte dtype (fp16 or bf16)."""
        return self in (CompressionKind.FP16, CompressionKind.BF16)


class TPStyle(StrEnum):
    """What a module's tensor-parallel layout does, in Megatron's words: the name the ILP
    pins and ``plan explain`` shows (the runtime applies the placements, not the style)."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    SEQUENCE_PARALLEL = "sequence_parallel"
    VOCAB_PARALLEL = "vocab_parallel"  # embedding sharded on the vocabulary dim
    REPLICATE = "replicate"
    BOUNDARY = "boundary"  # a block whose input or output changes placement (SP starts)


_STYLE_WORDS = {
    TPStyle.COLWISE: "column-parallel",
    TPStyle.ROWWISE: "row-parallel",
    TPStyle.VOCAB_PARALLEL: "vocabulary-parallel",
    TPStyle.SEQUENCE_PARALLEL: "sequence-parallel",
    TPStyle.REPLICATE: "replicated",
    TPStyle.BOUNDARY: "block boundary",
}

Placement = Annotated[str, Field(pattern=r"^(Replicate\(\)|Partial\(\)|Shard\(-?\d+\))$")]


def shard_dim(placement: str) -> int | None:
    """The dim a ``"Shard(d)"`` placement splits (``-1``: the last); ``None`` for
    ``"Replicate()"`` and ``"Partial()"``."""
    if placement.startswith("Shard("):
        return int(placement.removeprefix("Shard(").removesuffix(")"))
    return None


"""A DTensor placement over the tensor-parallel ranks, spelled as in torch."""


class _Doc(BaseModel):
    # Non-finite floats (NaN, Infinity) are refused in every document, on input; they are
    # never written either (to_json checks).
    model_config = ConfigDict(
        frozen=True, extra="forbid", use_enum_values=False, allow_inf_nan=False
    )

    @classmethod
    def from_json(cls, text: str, source: str = "") -> Self:
        """Validate JSON ``text`` (parsed strictly, see :func:`planner.io.parse_json`)."""
        data = parse_json(text, source or "(text)", what=cls.__name__)
        return load_document(cls, data, source or cls.__name__)

    def to_json(self) -> str:
        return document_json(self)


class ModuleTP(_Doc):
    """How one module runs on the tensor-parallel group: what the runtime applies.

    ``params``: each direct parameter's placement (absent: a plain tensor, whole on
    every rank). ``input``: the placement its first argument arrives in and the one it
    runs on; ``output``: the placement it produces and the one handed to its consumers
    (``Shard(1)``: the sequence, ``Shard(-1)``: the last dim, ``Partial()``: partial
    sums, reduced where the next block reads them). ``output_dtensor``: handed on as a
    DTensor, so its consumers' gradients are summed before one collective (or, sharded
    logits, the loss is vocabulary-parallel); otherwise as a local tensor. A module with
    placed parameters computes on DTensors: without ``input`` (``output``) its first
    argument (its output) is ``Replicate()`` there.
    """

    style: TPStyle
    params: dict[str, Placement] = {}
    input: tuple[Placement, Placement] | None = None
    output: tuple[Placement, Placement] | None = None
    output_dtensor: bool = False

    @property
    def shards_parameters(self) -> bool:
        """Some direct parameter is split over the ranks."""
        return any(shard_dim(p) is not None for p in self.params.values())

    @property
    def loss_parallel(self) -> bool:
        """It hands its output on as a sharded DTensor: vocabulary-sharded logits, which
        the loss reads under ``loss_parallel()``."""
        return (
            self.output_dtensor
            and self.output is not None
            and shard_dim(self.output[1]) is not None
        )

    def describe(self) -> str:
        """In words: ``column-parallel; weight Shard(0); in Shard(1) -> Replicate()``."""
        parts = [_STYLE_WORDS[self.style]]
        if self.params:
            parts.append(", ".join(f"{name} {p}" for name, p in self.params.items()))
        if self.input is not None and self.input[0] != self.input[1]:
            parts.append(f"in {self.input[0]} -> {self.input[1]}")
        if self.output is not None and self.output[0] != self.output[1]:
            parts.append(f"out {self.output[0]} -> {self.output[1]}")
        if self.output_dtensor:
            parts.append("out as DTensor")
        return "; ".join(parts)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.input is not None and self.input[1] == "Partial()":
            raise ValueError(
                "input runs on Partial(): a module computes on a value, not partial sums"
            )
        if self.output_dtensor and self.output is None:
            raise ValueError("output_dtensor needs output placements")
        return self


class ModelSpec(_Doc):
    """A decoder (gpt, llama) or encoder transformer, enough to build and cost it."""

    schema_version: Literal[1] = SCHEMA_VERSION
    name: str = "custom"
    family: Family
    num_layers: Layers
    hidden_size: Hidden
    num_heads: Heads
    num_kv_heads: Heads | None = None  # None: same as num_heads (no GQA)
    # Query/key/value features per head (None: hidden_size // num_heads); Qwen3's
    # 32 heads of 128 on a 2048 hidden state set it.
    head_dim: FfnSize | None = None
    qk_norm: bool = False  # RMSNorm of every query and key head before rotary (Qwen3)
    ffn_hidden_size: FfnSize | None = None  # None: 4 * hidden (gelu), Llama rule (swiglu)
    vocab_size: Vocab
    seq_len: SeqLen
    activation: Activation | None = None  # None: swiglu for llama, gelu otherwise
    tied_embeddings: bool = False
    norm_eps: float = Field(default=1e-5, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    # Mixture of experts (num_experts = 0: dense). Each MoE block routes every token to
    # top_k of num_experts gated experts of moe_ffn_hidden_size, plus num_shared_experts
    # that see every token; the first dense_layers blocks keep a dense feed-forward.
    num_experts: Experts = 0
    top_k: Experts = 0
    moe_ffn_hidden_size: FfnSize | None = None  # None: ffn_hidden_size
    num_shared_experts: Experts = 0
    dense_layers: int = Field(default=0, ge=0)
    # Multi-head latent attention (DeepSeek-V2/V3) when kv_lora_rank is set: keys and
    # values come from a kv_lora_rank latent, queries from a q_lora_rank one (None: a
    # direct projection); each head has qk_nope_head_dim + qk_rope_head_dim query/key
    # features and v_head_dim value features.
    kv_lora_rank: FfnSize | None = None
    q_lora_rank: FfnSize | None = None
    qk_nope_head_dim: FfnSize | None = None
    qk_rope_head_dim: FfnSize | None = None
    v_head_dim: FfnSize | None = None

    @model_validator(mode="after")
    def _check_experts(self) -> Self:
        if not self.num_experts:
            if self.top_k or self.num_shared_experts or self.moe_ffn_hidden_size:
                raise ValueError(
                    "top_k, num_shared_experts and moe_ffn_hidden_size describe experts: "
                    "set num_experts (> 0) or leave them unset"
                )
            return self
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts}): "
                "each token is routed to top_k experts"
            )
        if self.family is not Family.LLAMA:
            raise ValueError(
                f"num_experts ({self.num_experts}) with family {self.family.value!r}: the zoo's "
                "experts are gated (swiglu) and bias-free; use family 'llama'"
            )
        if self.dense_layers >= self.num_layers:
            raise ValueError(
                f"dense_layers ({self.dense_layers}) must be < num_layers ({self.num_layers}): "
                "at least one block has experts"
            )
        return self

    @model_validator(mode="after")
    def _check_latent_attention(self) -> Self:
        mla = (self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if self.kv_lora_rank is None:
            if self.q_lora_rank is not None or any(d is not None for d in mla):
                raise ValueError(
                    "q_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim describe "
                    "multi-head latent attention: set kv_lora_rank or leave them unset"
                )
            return self
        if self.head_dim is not None:
            raise ValueError(
                f"head_dim ({self.head_dim}) with kv_lora_rank ({self.kv_lora_rank}): latent "
                "attention's heads are qk_nope_head_dim + qk_rope_head_dim and v_head_dim "
                "wide; leave head_dim unset"
            )
        if any(d is None for d in mla) or self.family is not Family.LLAMA:
            raise ValueError(
                f"kv_lora_rank ({self.kv_lora_rank}) needs qk_nope_head_dim, qk_rope_head_dim "
                "and v_head_dim, and family 'llama'"
            )
        if self.qk_rope_head_dim is not None and self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (rotary)")
        return self

    @model_validator(mode="after")
    def _check_shapes(self) -> Self:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}), or set head_dim"
            )
        if self.kv_heads > self.num_heads or self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.kv_heads})"
            )
        if self.qk_norm and (self.family is not Family.LLAMA or self.latent_attention):
            raise ValueError(
                f"qk_norm with family {self.family.value!r}"
                + (" and kv_lora_rank" if self.latent_attention else "")
                + ": per-head q/k norms are for standard attention of family 'llama'"
            )
        if self.family is Family.LLAMA and self.head_size % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_size}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        """Features of one attention head: ``head_dim``, or ``hidden_size // num_heads``."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def act(self) -> Activation:
        if self.activation is not None:
            return self.activation
        return Activation.SWIGLU if self.family is Family.LLAMA else Activation.GELU

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.act is Activation.SWIGLU:  # Llama: 2/3 of 4h, rounded up to a multiple of 256
            return 256 * math.ceil(int(8 * self.hidden_size / 3) / 256)
        return 4 * self.hidden_size

    @property
    def causal(self) -> bool:
        return self.family is not Family.ENCODER

    @property
    def moe(self) -> bool:
        """Whether some blocks route tokens to experts."""
        return self.num_experts > 0

    @property
    def expert_ffn_size(self) -> int:
        """Intermediate width of one routed (or shared) expert."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def latent_attention(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank is not None

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has experts."""
        return self.moe and index >= self.dense_layers

    def with_seq_len(self, seq_len: int) -> ModelSpec:
        return ModelSpec.model_validate({**self.model_dump(), "seq_len": seq_len})

    def num_params(self) -> int:
        """Parameter count of the model :func:`planner.models.build` makes from this spec."""
        return self._count_params(experts_counted=self.num_experts)

    def active_params(self) -> int:
        """Parameters one token uses: routed experts counted ``top_k`` times, not
        ``num_experts`` (the count MoE model FLOPs and MFU are reported on)."""
        return self._count_params(experts_counted=self.top_k)

    def _count_params(self, *, experts_counted: int) -> int:
        h, v = self.hidden_size, self.vocab_size
        bias = self.family is not Family.LLAMA
        mlp_mats = 3 if self.act is Activation.SWIGLU else 2
        dense_mlp = mlp_mats * h * self.ffn_size + ((self.ffn_size + h) if bias else 0)
        norms = 2 * h * (2 if bias else 1)
        dense_block = self._attention_params() + dense_mlp + norms
        expert = 3 * h * self.expert_ffn_size
        moe_mlp = self.num_experts * h + (experts_counted + self.num_shared_experts) * expert
        moe_block = self._attention_params() + moe_mlp + norms
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_layers))
        blocks = (self.num_layers - moe_layers) * dense_block + moe_layers * moe_block
        embed = v * h + (0 if self.family is Family.LLAMA else self.seq_len * h)
        head = 0 if self.tied_embeddings else v * h
        final_norm = h * (2 if bias else 1)
        return blocks + embed + head + final_norm

    def _attention_params(self) -> int:
        h, heads = self.hidden_size, self.num_heads
        if self.kv_lora_rank is not None:  # multi-head latent attention (DeepSeek-V3)
            nope, rope = self.qk_nope_head_dim or 0, self.qk_rope_head_dim or 0
            v_dim, q_dim = self.v_head_dim or 0, heads * (nope + rope)
            q = h * q_dim if self.q_lora_rank is None else (
                h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q_dim
            )  # fmt: skip
            kv = h * (self.kv_lora_rank + rope) + self.kv_lora_rank
            kv += self.kv_lora_rank * heads * (nope + v_dim)
            return q + kv + heads * v_dim * h
        q, kv = heads * self.head_size, self.kv_heads * self.head_size
        bias = self.family is not Family.LLAMA  # q, k, v biases and the output's (h)
        qk_norms = 2 * self.head_size if self.qk_norm else 0
        return 2 * h * q + 2 * h * kv + (q + 2 * kv + h if bias else 0) + qk_norms


class LinkTier(_Doc):
    """A network level above the nodes (a site, a building): domains of ``domain_size``
    GPUs joined by links of ``uplink_GBps`` each.

    ``uplink_GBps`` is one domain's link to the others, one direction, shared by every
    collective group whose ring leaves the domain (100 Gb/s between two sites is
    ``uplink_GBps: 12.5``).
    """

    name: str
    domain_size: GpuCount  # GPUs inside one domain (256 for a site of 32 DGX nodes)
    uplink_GBps: Bandwidth  # per domain, one direction, shared
    latency_us: Latency


class Cluster(_Doc):
    """GPUs of one profile, ``gpus_per_node`` to a node.

    Link bandwidths and latencies default to the GPU profile's; the ``*_GBps`` and
    ``*_us`` fields override them for this cluster. ``inter_node_latency_us`` is the
    network's step (a fabric that is not the profile's InfiniBand: AWS EFA, TCP): every
    protocol's step across nodes takes at least that long.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    name: str = ""  # a shipped cluster profile's name
    description: str = ""
    gpu: str
    num_gpus: GpuCount
    gpus_per_node: NodeSize = 8
    intra_node_GBps: Bandwidth | None = None
    inter_node_GBps: Bandwidth | None = None
    intra_node_latency_us: Latency | None = None
    inter_node_latency_us: Latency | None = None
    extra_tiers: tuple[LinkTier, ...] = ()  # slower tiers above the node network (sites)

    @model_validator(mode="after")
    def _check_nodes(self) -> Self:
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"num_gpus ({self.num_gpus}) must be a multiple of gpus_per_node "
                f"({self.gpus_per_node}) when it spans several nodes"
            )
        return self

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    def with_gpus(self, num_gpus: int) -> Cluster:
        """This cluster with ``num_gpus`` GPUs; raises ``ValidationError`` for a count
        its nodes cannot hold."""
        return type(self).model_validate({**self.model_dump(), "num_gpus": num_gpus})


class Training(_Doc):
    """What is trained per optimizer step and in which precision.

    ``dtype`` is the compute precision; ``param_dtype`` the one parameters, gradients
    and optimizer states are kept in: fp32 (mixed precision: an fp32 copy beside the
    half-precision compute, the default) or bf16 (pure bf16 training, no fp32 copy:
    torchtitan's ``training.dtype = "bfloat16"``, NeMo AutoModel's MoE models).
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    global_batch_size: BatchSize  # sequences per optimizer step
    micro_batch_size: BatchSize | None = None  # None: the search chooses
    seq_len: SeqLen | None = None  # None: the model's seq_len
    dtype: DType = DType.BF16
    param_dtype: Literal[DType.FP32, DType.BF16] = DType.FP32
    optimizer: Optimizer = Optimizer.ADAMW
    grad_clip: bool = True

    @model_validator(mode="after")
    def _check_precision(self) -> Self:
        if self.param_dtype is DType.BF16 and self.dtype not in (DType.BF16, DType.FP8):
            raise ValueError(
                f"param_dtype 'bf16' (pure bf16 training) with dtype {self.dtype.value!r}: "
                "parameters kept in bf16 are computed in bf16 (or fp8); use dtype bf16, or "
                "param_dtype fp32"
            )
        return self

    @property
    def state_bytes(self) -> int:
        """Bytes of one parameter, gradient or optimizer-moment element as kept: 4 (an
        fp32 copy) or 2 (pure bf16)."""
        return FP32_BYTES if self.param_dtype is DType.FP32 else HALF_BYTES

    @property
    def moment_bytes(self) -> float:
        """Bytes of the optimizer's moments per parameter as kept (Adam two, SGD one)."""
        return self.optimizer.state_bytes_per_param * self.state_bytes / FP32_BYTES

    @property
    def master_copy(self) -> bool:
        """Whether an fp32 copy of the weights sits beside half-precision ones (mixed
        precision; fp32 and pure bf16 training keep one copy)."""
        return self.dtype is not DType.FP32 and self.param_dtype is DType.FP32


class Compression(_Doc):
    """Gradient compression applied to the data-parallel reduction.

    - ``fp16``/``bf16``: gradients reduced in 2 bytes (DDP hook or FSDP reduce dtype).
    - ``powersgd``: rank-``rank`` approximations with error feedback (DDP hook), after
      ``warmup_steps`` uncompressed steps.
    - ``int8``: FSDP2's gradient reduce-scatter as an int8 all-to-all with an fp32 scale
      per 256-element block, summed in fp32 (ZeRO >= 1; :mod:`strategies.int8_reduce_scatter`).
    - ``local_sgd``: after ``warmup_steps`` global steps, gradients are all-reduced only
      among ``local_group`` consecutive data-parallel ranks (a fast domain) and the
      parameters are averaged over all of them every ``period`` optimizer steps
      (``post_localSGD_hook`` with ``PeriodicModelAverager``).
    """

    kind: CompressionKind = CompressionKind.NONE
    rank: Rank | None = None  # powersgd: matrix rank
    warmup_steps: int = Field(default=0, ge=0)  # powersgd, local_sgd: uncompressed steps first
    period: int | None = Field(default=None, ge=2)  # local_sgd: steps between averages
    local_group: GpuCount | None = None  # local_sgd: data-parallel ranks reducing each step

    @model_validator(mode="after")
    def _check_fields(self) -> Self:
        kind = self.kind
        if kind is CompressionKind.POWERSGD and self.rank is None:
            raise ValueError("compression kind 'powersgd' needs a rank (e.g. rank: 4)")
        if kind is not CompressionKind.POWERSGD and self.rank is not None:
            raise ValueError(f"rank only applies to powersgd, not {kind.value!r}")
        local = (self.period, self.local_group)
        if kind is CompressionKind.LOCAL_SGD and None in local:
            raise ValueError(
                "compression kind 'local_sgd' needs period (steps between parameter averages, "
                ">= 2) and local_group (data-parallel ranks that reduce every step)"
            )
        if kind is not CompressionKind.LOCAL_SGD and local != (None, None):
            raise ValueError(f"period and local_group only apply to local_sgd, not {kind.value!r}")
        return self

    def describe(self) -> str:
        """``'none'``, ``'bf16'``, ``'powersgd(r4)'``, ``'local_sgd(H8,g4)'``."""
        if self.kind is CompressionKind.POWERSGD:
            return f"powersgd(r{self.rank})"
        if self.kind is CompressionKind.LOCAL_SGD:
            return f"local_sgd(H{self.period},g{self.local_group})"
        return self.kind.value


def virtual_stages_problem(schedule: Schedule | None, virtual_stages: int) -> str | None:
    """Why ``virtual_stages`` model chunks per pipeline rank cannot run under ``schedule``
    (``None``: any schedule may be chosen), or ``None``."""
    if virtual_stages > 1 and schedule not in (None, Schedule.INTERLEAVED_1F1B):
        return f"virtual_stages ({virtual_stages}) > 1 needs schedule 'interleaved-1f1b'"
    return None


class Strategy(_Doc):
    """How one training step is split over GPUs.

    ``dp = dp_replicate * dp_shard``. ZeRO stages shard over ``dp_shard``: 1 optimizer
    states, 2 plus gradients, 3 plus weights (FSDP, weights gathered per block).
    Hybrid sharding is ``zero >= 1`` with ``1 < dp_shard < dp``.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    dp: GpuCount = 1
    dp_shard: GpuCount | None = None  # None: dp when zero >= 1, else 1
    tp: GpuCount = 1
    pp: GpuCount = 1
    cp: GpuCount = 1
    ep: GpuCount = 1  # expert parallel: experts split over ep ranks of dp x cp x tp
    etp: GpuCount = 1  # expert tensor parallel: each expert's width split over etp ranks
    zero: Literal[0, 1, 2, 3] = 0
    sequence_parallel: bool = False
    recompute: RecomputeMode = RecomputeMode.NONE
    recompute_per_stage: tuple[RecomputeMode, ...] | None = None  # overrides per pp stage
    recompute_blocks: int | None = Field(
        default=None, ge=0
    )  # recompute first k blocks per model chunk
    micro_batch_size: BatchSize = 1
    num_microbatches: BatchSize = 1  # per optimizer step per data-parallel rank
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: ChunkCount = 1  # model chunks per pp rank (interleaved 1F1B)
    compression: Compression = Compression()

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.dp % self.shard_degree:
            raise ValueError(f"dp_shard ({self.shard_degree}) must divide dp ({self.dp})")
        if self.zero == 0 and self.shard_degree > 1:
            raise ValueError(f"dp_shard ({self.shard_degree}) > 1 needs zero >= 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        if self.etp > 1 and self.ep == 1:
            raise ValueError(
                f"etp ({self.etp}) > 1 needs ep > 1: experts are split over tensor-parallel "
                "ranks only beside expert parallelism; set ep >= 2 or etp = 1"
            )
        chunks = virtual_stages_problem(self.schedule, self.virtual_stages)
        if chunks is not None:
            raise ValueError(chunks)
        if self.recompute_per_stage is not None and len(self.recompute_per_stage) != self.pp:
            raise ValueError(
                f"recompute_per_stage has {len(self.recompute_per_stage)} entries, pp is {self.pp}"
            )
        return self

    @property
    def shard_degree(self) -> int:
        """Size of the dp_shard mesh axis."""
        if self.dp_shard is not None:
            return self.dp_shard
        return self.dp if self.zero >= 1 else 1

    @property
    def replicate_degree(self) -> int:
        return self.dp // self.shard_degree

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def parallel_dimensions(self) -> int:
        """How many of dp, tp, pp and cp are larger than 1."""
        return sum(degree > 1 for degree in (self.dp, self.tp, self.pp, self.cp))

    @property
    def num_stages(self) -> int:
        """Pipeline model chunks in total (pp ranks times virtual stages)."""
        return self.pp * self.virtual_stages

    def recompute_for_stage(self, stage: int) -> RecomputeMode:
        if self.recompute_per_stage is not None:
            return self.recompute_per_stage[stage]
        return self.recompute

    def mesh_axes(self) -> tuple[MeshAxis, ...]:
        """Mesh axes of size > 1 in :data:`MESH_ORDER` (outermost to innermost)."""
        sizes = {
            Axis.PP: self.pp,
            Axis.DP_REPLICATE: self.replicate_degree,
            Axis.DP_SHARD: self.shard_degree,
            Axis.CP: self.cp,
            Axis.TP: self.tp,
        }
        return tuple(MeshAxis(name=a, size=sizes[a]) for a in MESH_ORDER if sizes[a] > 1)

    def _recompute_text(self) -> str:
        """``full``, ``full(first 2 blocks/chunk)`` or, per stage, ``full,none``."""
        if self.recompute_per_stage:
            return ",".join(mode.value for mode in self.recompute_per_stage)
        if self.recompute_blocks is not None and self.recompute is not RecomputeMode.NONE:
            return f"{self.recompute.value}(first {self.recompute_blocks} blocks/chunk)"
        return self.recompute.value

    def describe(self) -> str:
        """One line such as ``dp8(zero1) tp8 sp pp16 1f1b mb1x12 recompute=full``."""
        from planner.parallel_dims import ParallelDims  # it reads this module

        parts = [f"dp{self.dp}"]
        if self.zero:
            hybrid = ParallelDims.of(self).hybrid_sharding
            hsdp = f",shard{self.shard_degree}" if hybrid else ""
            parts[0] += f"(zero{self.zero}{hsdp})"
        sizes = (("tp", self.tp), ("cp", self.cp), ("ep", self.ep), ("etp", self.etp))
        for name, size in sizes:
            if size > 1:
                parts.append(f"{name}{size}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            v = f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pp} {self.schedule.value}{v}")
        parts.append(f"mb{self.micro_batch_size}x{self.num_microbatches}")
        parts.append(f"recompute={self._recompute_text()}")
        if self.compression.kind is not CompressionKind.NONE:
            parts.append(f"compress={self.compression.describe()}")
        return " ".join(parts)


class MeshAxis(_Doc):
    name: Axis
    size: GpuCount


class ErrorBand(_Doc):
    """How far the cost model has been from published runs in one prediction's regime
    (:mod:`planner.cost.error_band` says which regime and measures the band).

    Errors are fractions of the measured value, ``+`` where the model predicted slower
    (or more memory). ``step_*`` are ``None`` when fewer than
    :data:`planner.cost.error_band.MIN_RUNS` published runs lie in the regime:
    calibrate before relying on the prediction."""

    family: Literal["dense", "moe"]
    precision: Literal["bf16/fp16", "fp8", "fp32"]
    device_kind: Literal["gpu", "cpu"]
    comm_share: Literal["<15%", "15-30%", ">=30%"]  # exposed communication / step time
    runs: int = 0  # published runs priced in this regime
    step_mean_abs: float | None = None
    step_max_abs: float | None = None
    step_bias: float | None = None  # mean signed error
    devices: tuple[str, ...] = ()  # the GPU profiles those runs were priced on
    memory_runs: int = 0  # the family's runs on the device kind with a measured peak
    memory_mean_abs: float | None = None
    memory_max_abs: float | None = None

    @property
    def regime(self) -> str:
        return (
            f"{self.family} {self.precision} on {self.device_kind}, exposed communication "
            f"{self.comm_share} of the step"
        )


def communication_s(breakdown: Mapping[str, float]) -> float:
    """Seconds of a step breakdown (predicted ``breakdown_s`` or measured phases) spent
    in communication: its ``comm*`` terms."""
    return sum(v for k, v in breakdown.items() if k.startswith("comm"))


def compute_s(breakdown: Mapping[str, float]) -> float:
    """Seconds of a predicted step breakdown spent in the forward and backward passes:
    compute, recompute and the gradients' accumulation over micro-batches."""
    return sum(breakdown.get(term, 0.0) for term in ("compute", "recompute", "grad_accumulation"))


class MemoryBand(_Doc):
    """Peak-memory error (fractions) of one family's published runs on one device kind
    that report one."""

    family: Literal["dense", "moe"]
    device_kind: Literal["gpu", "cpu"]
    runs: int
    mean_abs: float
    max_abs: float


class ErrorBandTable(_Doc):
    """Step-time bands per regime and memory bands per family and device kind, as
    ``command`` measured them (``profiles/validation/error_bands.json``)."""

    schema_version: Literal[1] = 1
    command: str
    step: tuple[ErrorBand, ...] = ()
    memory: tuple[MemoryBand, ...] = ()


class Prediction(_Doc):
    """Predicted cost of one step; the breakdown adds up to ``step_time_s``."""

    step_time_s: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float  # model FLOPs / peak, fraction
    hfu: float  # hardware FLOPs (with recompute) / peak, fraction
    flop_convention: str
    peak_memory_gib: float
    memory_limit_gib: float
    fits: bool
    breakdown_s: dict[str, float] = {}
    memory_gib: dict[str, float] = {}
    reason: str = ""  # why it does not fit, or other caveats
    error_band: ErrorBand | None = None  # the model's measured error in this regime


class Candidate(_Doc):
    """A runner-up plan and why it lost to the chosen one."""

    strategy: Strategy
    prediction: Prediction
    lost_because: str


class SolverStats(_Doc):
    candidates_enumerated: int = 0
    candidates_costed: int = 0
    pruned_by_memory: int = 0
    search_time_s: float = 0.0
    ilp_status: str = ""
    ilp_objective: float | None = None
    ilp_time_s: float | None = None
    notes: tuple[str, ...] = ()


class TracedInput(_Doc):
    """A tensor argument of a module's forward as its plan traced it (batch 1, the plan's
    sequence length): what ``planner.parallelize`` traces the module with again when it
    has no ``example_inputs`` of its own."""

    dtype: str  # torch's name without its prefix: "int64", "float32"
    shape: tuple[int, ...]


class Plan(_Doc):
    """The planner's answer: a runnable strategy, where it applies, and why."""

    schema_version: Literal[1] = SCHEMA_VERSION
    planner_version: str
    model_name: str
    model_fingerprint: str  # see planner.models.fingerprint
    model: ModelSpec | None = None  # set for zoo and spec-file models
    model_source: str = ""  # how to rebuild the model: preset name, spec path or module:function
    model_digest: str = ""  # a traced model's priced graph (OpGraph.digest); "" for spec models
    inputs: tuple[TracedInput, ...] = ()  # a module of your own's traced forward arguments
    cluster: Cluster
    training: Training
    strategy: Strategy
    mesh: tuple[MeshAxis, ...]
    stages: tuple[tuple[str, ...], ...] = ()  # module FQNs per model chunk (torchtitan form)
    tp_layout: dict[str, ModuleTP] = {}  # module FQN (or pattern with *) -> how it runs
    target: str = "planner"  # the framework (==release) the search kept to: planner.frameworks
    prediction: Prediction | None = None
    tradeoffs: tuple[str, ...] = ()  # what the chosen lossy options trade, in words
    runners_up: tuple[Candidate, ...] = ()
    without_target: Candidate | None = None  # the fastest plan `target` cannot run, if faster
    solver: SolverStats = SolverStats()

    @property
    def loss_parallel(self) -> bool:
        """The output head hands on vocabulary-sharded logits: compute the loss under
        ``loss_parallel()`` (:func:`strategies.apply.loss_context`)."""
        return any(m.loss_parallel for m in self.tp_layout.values())

    @property
    def seq_len(self) -> int | None:
        """Tokens per sequence: the training's, else the model spec's (``None`` for a traced
        model planned without one)."""
        return self.training.seq_len or (self.model.seq_len if self.model is not None else None)

    @model_validator(mode="after")
    def _check_mesh(self) -> Self:
        world = math.prod(axis.size for axis in self.mesh)
        if world != self.strategy.world_size:
            raise ValueError(
                f"mesh sizes multiply to {world}, strategy needs {self.strategy.world_size}"
            )
        return self


DocT = TypeVar("DocT", bound=BaseModel)


def load_model_spec(path: str | Path) -> ModelSpec:
    """A ModelSpec JSON file; a Hugging Face ``config.json`` given instead is refused naming
    the option that takes it (not every ModelSpec field it lacks)."""
    data = read_json(path, what="ModelSpec file")
    if (document_kind(data) or ("",))[0] == "HuggingFaceConfig":
        raise SpecError(
            f"model {str(path)!r} is a Hugging Face config (model_type "
            f"{data['model_type']!r}), not a ModelSpec file: plan it with --hf-config (plan, "
            "plan trace; planner.resolve_hf_config); --model takes a preset, a ModelSpec JSON "
            "or module:function"
        )
    return load_document(ModelSpec, data, str(path))


def format_validation_error(error: ValidationError, source: str) -> str:
    """One line per invalid field: where, the value given, and what is allowed (a bound
    reads ``num_layers = 100000 > 10000: why``)."""
    lines = [f"invalid {error.title} in {source}:"]
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(document)"
        shown = _shown(item.get("input"))
        message = item["msg"].removeprefix("Value error, ")
        separator = " " if message.startswith(("> ", "< ")) else ": "
        lines.append(f"  {where} = {shown}{separator}{message}")
    return "\n".join(lines)


def _shown(value: Any) -> str:
    """A field's value as JSON, cut to 80 characters (``{...}`` for an object)."""
    if isinstance(value, dict):
        return "{...}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**80:
        return f"a {int(math.log10(abs(value))) + 1}-digit number"
    try:
        shown = json.dumps(value, default=str)
    except (ValueError, RecursionError):
        shown = repr(value)
    return shown[:80]


def load_document(cls: type[DocT], data: str | Path | dict[str, Any], source: str = "") -> DocT:
    """Validate ``data`` (a dict, JSON text, or the path of a JSON file: a ``Path``, or
    a string that does not start with ``{``) as ``cls``.

    Files and text go through :mod:`planner.io` (UTF-8, strict JSON: bounded size and
    depth, finite numbers). Raises :class:`SpecError` with one line per invalid field.
    """
    if isinstance(data, str) and not data.lstrip().startswith("{"):
        data = Path(data)
    what = f"{cls.__name__} file"
    if isinstance(data, Path):
        source = source or str(data)
        data = read_json(data, what=what)
    elif isinstance(data, str):
        source = source or cls.__name__
        data = parse_json(data, source, what=what)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        kind = document_kind(data)
        if kind is not None and kind[0] != cls.__name__:
            raise SpecError(
                f"{source or cls.__name__} is {kind[1]}, not a {cls.__name__} file: give it "
                "where that is taken (plan --help lists what each command reads)"
            ) from None
        raise SpecError(format_validation_error(exc, source or cls.__name__)) from None


# What each document this tool reads or writes holds at its top level, and what it is:
# the first whose keys a document has names it (a plan before a run, which it contains).
_DOCUMENT_KINDS = (
    ("MeasuredProfile", {"plan_fingerprint", "step_times_s"}, "a measured profile ('plan measure' output)"),
    ("Plan", {"strategy", "prediction"}, "a plan ('plan -o' output)"),
    ("RunConfig", {"model", "cluster", "training", "strategy"}, "a run config ('plan estimate --config' input)"),
    ("HardwareProfile", {"peak_tflops", "matmul_efficiency"}, "a hardware profile (--cluster, 'plan calibrate' output)"),
    ("Cluster", {"gpu", "num_gpus"}, "a cluster (--cluster)"),
    ("ModelSpec", {"num_layers", "hidden_size", "num_heads"}, "a ModelSpec (--model)"),
    ("HuggingFaceConfig", {"model_type"}, "a Hugging Face config (--hf-config)"),
)  # fmt: skip


def document_kind(data: object) -> tuple[str, str] | None:
    """Which of this tool's documents ``data`` looks like (its class name and a phrase
    naming it and where it goes), or ``None``."""
    if not isinstance(data, dict):
        return None
    for name, keys, what in _DOCUMENT_KINDS:
        if keys <= data.keys():
            return name, what
    return None
