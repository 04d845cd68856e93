"""Gradient compression on the data-parallel reduction: wire bytes, exposed compute, memory.

- ``fp16``/``bf16`` (DDP's ``fp16_compress_hook`` and its bf16 twin, FSDP's reduce
  dtype): the reduction moves 2 bytes per gradient element instead of the options'
  ``grad_reduce_bytes``; each bucket is cast down before and back up after
  (memory-bound: read one width, write the other). Nothing changes when gradients are
  already reduced in 2 bytes.
- ``powersgd`` rank ``r`` (Vogels et al. 2019, torch's ``powerSGD_hook`` with error
  feedback and warm start), per 2-D gradient ``M`` of ``m x n`` worth compressing
  (torch's rule: ``r (m + n) * 2 < m n``): the orthogonalization of ``Q`` and later of
  ``P`` (``~2 n r^2`` and ``~2 m r^2``: Gram-Schmidt's ``r`` columns of small kernels up
  to rank 2, one QR above), ``P = M Q`` and ``Q = M^T P`` (``2 m n r`` FLOPs each, at the
  profile's ``narrow_matmul_width`` where its BLAS runs narrow outputs that wide) and
  the decompression ``P Q^T`` (``2 m n r``). Per bucket three all-reduces run one after
  another: the uncompressed tensors (biases, norms, small matrices), all ``P`` and all
  ``Q``. Error feedback adds the error to the bucket, clones it and subtracts the
  decompressed result (3 memory-bound kernels, 8 element passes) and keeps an error
  buffer the size of the gradients plus the persistent ``P`` and ``Q``.

- ``int8`` (FSDP2, :mod:`strategies.int8_reduce_scatter`): the reduce-scatter sends
  ``1 + 4 / 256`` bytes per gradient element (int8 plus an fp32 scale per 256-element
  block) by all-to-all, with a ring's ``(n - 1) / n`` volume and ``n - 1`` latencies;
  quantizing and the fp32 sum of the dequantized chunks take about 6 passes over the
  fp32 gradients; the int8 copy and the dequantized chunks of one module are transient.
  A hybrid-sharding replica all-reduce stays in the reduce dtype.

The compression compute runs inside the hook on the critical path, so it is counted
exposed; steady state is priced (PowerSGD's uncompressed warm-up steps are not).

Every option offered composes with all-reduce (a sum of fp16 values, of ``P`` or of
``Q`` factors is what the next step needs). A compressor that does not (int8 with
per-rank scales, top-k) must all-gather every rank's payload instead, which grows with
the group: see :func:`all_gather_break_even_ranks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.cost.communication import Collective, LinkModel, collective_time
from planner.cost.compute import ComputeModel
from planner.cost.tp import TPAssignment
from planner.dtypes import ELEMENT_BYTES, FP32_BYTES, HALF_BYTES
from planner.graph import OpGraph, OpKind, OpNode
from planner.hardware import HardwareProfile
from planner.spec import CompressionKind

__all__ = [
    "max_useful_rank",
    "GradientShapes",
    "INT8_WIRE_BYTES",
    "all_gather_break_even_ranks",
    "int8_buffer_bytes",
    "int8_quantize_time",
    "bucket_count",
    "PowerSGDWork",
    "gradient_shapes",
    "should_compress",
    "powersgd_work",
    "powersgd_compute_time",
    "narrow_product_width",
    "powersgd_comm_time",
    "powersgd_memory_bytes",
    "half_wire_bytes",
    "reduce_dtype_bytes",
    "half_cast_time",
]

# torch's PowerSGDState default: compress a matrix only if it shrinks more than 2x
_MIN_COMPRESSION_RATE = 2
# torch's _orthogonalize_gram_schmidt per column: norm, add epsilon, divide; then
# multiply, sum, multiply, subtract to remove the column from the rest
_GRAM_SCHMIDT_KERNELS_PER_COLUMN = 7
# error feedback per bucket: add the error (read 2, write 1), clone (read 1, write 1),
# error = clone - decompressed (read 2, write 1)
_ERROR_FEEDBACK_PASSES = 8
_ERROR_FEEDBACK_KERNELS = 3
_INT8_BLOCK = 256  # elements per fp32 scale (strategies.int8_reduce_scatter.BLOCK)
INT8_WIRE_BYTES = ELEMENT_BYTES["int8"] + FP32_BYTES / _INT8_BLOCK  # per gradient element
# absmax, scale, round, clamp and cast read or write the fp32 chunks; dequantize and sum
_INT8_FP32_PASSES = 6
_INT8_KERNELS = 8


@dataclass(frozen=True)
class GradientShapes:
    """One rank's gradients: 2-D matrices ``(m, n)`` and the elements of 1-D tensors."""

    matrices: tuple[tuple[int, int], ...]
    vector_elements: float

    @property
    def elements(self) -> float:
        """Every gradient element on the rank."""
        return sum(m * n for m, n in self.matrices) + self.vector_elements


@dataclass(frozen=True)
class PowerSGDWork:
    """What PowerSGD rank ``r`` does per step on one rank (elements, FLOPs)."""

    compressed: tuple[tuple[int, int], ...]  # matrices compressed to P (m x r) and Q (n x r)
    p_elements: float  # r * sum(m): the first all-reduce
    q_elements: float  # r * sum(n): the second all-reduce
    uncompressed_elements: float  # vectors and matrices not worth compressing
    product_flops: float  # 6 m n r per compressed matrix: P = M Q, Q = M^T P, P Q^T
    orthogonalize_flops: float  # 2 (m + n) r^2 per compressed matrix (Q's and P's)


def _matrix(node: OpNode, held: float) -> tuple[int, int] | None:
    """A linear's weight ``(out, in)`` or an embedding table ``(rows, width)`` per rank,
    for a node holding ``held`` parameters on this rank (the split taken off its rows)."""
    if node.kind is OpKind.MATMUL and node.gemm is not None:
        _, _, out_features, in_features = node.gemm
        shards = node.param_count / held
        return max(1, round(out_features / shards)), in_features
    is_table = node.kind is OpKind.EMBEDDING or node.module.endswith("embeddings")
    if is_table and node.output_shape:
        width = node.output_shape[-1]
        return max(1, int(held // width)), width
    return None


def gradient_shapes(graph: OpGraph, layout: TPAssignment) -> GradientShapes:
    """Weight matrices of the linears and embedding tables of ``graph``, per TP shard.

    A linear's ``gemm`` is ``(1, tokens, out, in)``; a tensor-parallel split divides
    ``out`` (the row-parallel layers really split ``in``: same ``m n``, and ``r (m + n)``
    differs by at most ``r |m - n| / tp``). Parameters outside these matrices (biases,
    norms) are vectors, sent uncompressed.
    """
    matrices: list[tuple[int, int]] = []
    vectors = 0.0
    for segment in graph.segments:
        seg_type = graph.segment_type(segment)
        held_per_node = layout.segment(seg_type.type_id).param_elements
        for node, held in zip(seg_type.nodes, held_per_node, strict=True):
            if node.param_count == 0 or held <= 0:
                continue
            matrix = _matrix(node, held)
            if matrix is None:
                vectors += held
                continue
            matrices.append(matrix)
            vectors += max(0.0, held - matrix[0] * matrix[1])
    return GradientShapes(tuple(matrices), vectors)


def should_compress(m: int, n: int, rank: int) -> bool:
    """torch's rule: compress ``m x n`` only if ``P`` and ``Q`` are less than half of it."""
    return (m + n) * rank * _MIN_COMPRESSION_RATE < m * n


def max_useful_rank(m: int, n: int) -> int:
    """The largest rank at which torch's PowerSGD still compresses an ``m x n`` matrix."""
    return max(0, (m * n - 1) // (_MIN_COMPRESSION_RATE * (m + n)))


def powersgd_work(shapes: GradientShapes, rank: int) -> PowerSGDWork:
    """Elements all-reduced and FLOPs of PowerSGD rank ``rank`` over ``shapes``."""
    compressed = tuple((m, n) for m, n in shapes.matrices if should_compress(m, n, rank))
    kept = sum(m * n for m, n in shapes.matrices if not should_compress(m, n, rank))
    return PowerSGDWork(
        compressed=compressed,
        p_elements=float(rank * sum(m for m, _ in compressed)),
        q_elements=float(rank * sum(n for _, n in compressed)),
        uncompressed_elements=shapes.vector_elements + kept,
        product_flops=float(sum(6 * m * n * rank for m, n in compressed)),
        orthogonalize_flops=float(sum(2 * (m + n) * rank * rank for m, n in compressed)),
    )


def powersgd_compute_time(
    work: PowerSGDWork, rank: int, buckets: int, gradient_elements: float,
    compute: ComputeModel, element_bytes: int,
) -> float:  # fmt: skip
    """Seconds of PowerSGD's products, orthogonalizations and error feedback per step
    (exposed)."""
    width = narrow_product_width(compute.profile, rank)
    seconds = 0.0
    for m, n in work.compressed:
        io = (m * n + (m + n) * rank) * element_bytes
        # P = M Q and Q = M^T P: a narrow output; P Q^T: the whole matrix
        seconds += 2 * compute.gemm_time(2 * m * n * width, io)
        seconds += compute.gemm_time(2 * m * n * rank, io)
        seconds += _orthogonalize_time(n, rank, compute, element_bytes)  # Q (warm start)
        seconds += _orthogonalize_time(m, rank, compute, element_bytes)  # P
    feedback = _ERROR_FEEDBACK_PASSES * gradient_elements * element_bytes
    seconds += compute.memory_time(feedback) + (_ERROR_FEEDBACK_KERNELS * buckets - 1) * (
        compute.kernel_s
    )
    return seconds


def narrow_product_width(profile: HardwareProfile, rank: int) -> float:
    """Output columns a rank-``rank`` product ``M Q`` computes as: its own, or the
    profile's ``narrow_matmul_width`` where the BLAS kernel runs narrower outputs at
    that width (a matrix-vector product, ``rank`` 1, takes the GEMV path)."""
    if rank == 1 or profile.narrow_matmul_width is None:
        return float(rank)
    return max(float(rank), profile.narrow_matmul_width)


def _orthogonalize_time(rows: int, rank: int, compute: ComputeModel, element_bytes: int) -> float:
    """torch's ``_orthogonalize`` of one ``rows x rank`` factor: Gram-Schmidt column by
    column (rank <= 2 or half precision), else one QR factorization."""
    work = compute.memory_time(2 * rows * rank * rank * element_bytes)
    if rank <= 2 or element_bytes < FP32_BYTES:
        return work + (_GRAM_SCHMIDT_KERNELS_PER_COLUMN * rank - 1) * compute.kernel_s
    return work  # one LAPACK call


def powersgd_comm_time(
    work: PowerSGDWork, buckets: int, ranks: int, link: LinkModel, element_bytes: int
) -> tuple[float, float]:
    """(all buckets', the last bucket's) seconds of the three chained all-reduces.

    The step's elements are spread evenly over ``buckets``; each bucket pays the
    uncompressed, the ``P`` and the ``Q`` all-reduce's latency.
    """
    per_bucket = 0.0
    for elements in (work.uncompressed_elements, work.p_elements, work.q_elements):
        size = elements * element_bytes / buckets
        per_bucket += collective_time(Collective.ALL_REDUCE, size, ranks, link)
    return buckets * per_bucket, per_bucket


def powersgd_memory_bytes(
    work: PowerSGDWork, gradient_elements: float, element_bytes: int
) -> float:
    """Error-feedback buffer (every gradient element) and the persistent ``P`` and ``Q``, in
    bytes: what PowerSGD keeps between steps. The bucket clone it makes inside the hook is
    freed before the hook returns, late in backward, so it is not at the step's peak."""
    return (gradient_elements + work.p_elements + work.q_elements) * element_bytes


def half_wire_bytes(reduce_bytes: int) -> int:
    """Bytes per gradient element on the wire with fp16/bf16 compression."""
    return min(reduce_bytes, HALF_BYTES)


def reduce_dtype_bytes(kind: CompressionKind, reduce_bytes: int) -> int:
    """Bytes of the dtype gradients are reduced in: 2 under fp16/bf16 compression, else
    ``reduce_bytes`` (``CostOptions.grad_reduce_bytes``)."""
    return half_wire_bytes(reduce_bytes) if kind.half else reduce_bytes


def half_cast_time(
    gradient_elements: float, buckets: int, reduce_bytes: int, compute: ComputeModel
) -> float:
    """Seconds of casting every bucket to 2 bytes and back (0 if already 2 bytes)."""
    if reduce_bytes <= HALF_BYTES:
        return 0.0
    per_cast = gradient_elements * (reduce_bytes + HALF_BYTES)
    return 2 * (compute.memory_time(per_cast) + (buckets - 1) * compute.kernel_s)


def bucket_count(gradient_bytes: float, bucket_bytes: float) -> int:
    """DDP buckets the gradients fill (at least one)."""
    return max(1, math.ceil(gradient_bytes / bucket_bytes))


def all_gather_break_even_ranks(compression_ratio: float) -> int:
    """The largest group for which all-gathering payloads compressed ``compression_ratio``
    times moves fewer bytes per rank than an uncompressed ring all-reduce.

    All-reduce receives ``2 (n - 1) / n * S`` per rank, an all-gather of ``S / c`` per rank
    ``(n - 1) * S / c``: the all-gather wins while ``n < 2 c`` (int8 against fp32, ``c = 4``:
    up to 7 ranks).
    """
    return max(1, math.ceil(2 * compression_ratio) - 1)


def int8_quantize_time(gradient_elements: float, compute: ComputeModel) -> float:
    """Seconds of quantizing to int8 and summing the dequantized chunks in fp32, per step."""
    passes = _INT8_FP32_PASSES * gradient_elements * FP32_BYTES
    return compute.memory_time(passes) + _INT8_KERNELS * compute.kernel_s


def int8_buffer_bytes(module_params: float) -> float:
    """Transient bytes of one module's int8 reduce-scatter: the int8 copy and the
    dequantized fp32 chunks of its gradients."""
    return module_params * (INT8_WIRE_BYTES + FP32_BYTES)
