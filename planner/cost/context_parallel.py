"""Context-parallel attention as each implementation runs it (``CostOptions.cp_attention``).

A rank holds ``1 / cp`` of every sequence (two load-balanced chunks); its attention meets
the other ranks' keys and values in one of two ways:

- ``all-gather`` (this runtime, :mod:`strategies.context_parallel`): keys and values are
  all-gathered whole before attention (two blocking collectives back to back, keys then
  values: one wait for the slowest rank, ``LinkModel.call_s``) and
  copied into sequence order; each local chunk runs one SDPA over the keys up to its end
  with a lower-right causal mask, which the kernel computes whole: a rank computes
  ``(2 cp + 1) / (4 cp)`` of its queries' scores against every key (its causal share plus
  the masked halves of its two diagonal blocks). Backward reduce-scatters the keys' and
  values' gradients (blocking). The gathered keys and values stay saved for backward,
  and the two chunks' masks are kept (one per shape, shared by the layers).
- ``ring`` (torch's ``context_parallel`` as torchtitan runs it,
  ``torch/distributed/tensor/experimental/_attention.py``; Megatron-Core's on Transformer
  Engine): ``cp`` causal-balanced kernel steps of ``1 / cp`` of the work each. Forward
  all-gathers keys and values once, under the first step; each step's output merges into
  an fp32 accumulator (``_SDPAMerger``: a cast, three elementwise passes and, on partial
  steps, a concatenation). Backward gathers keys and values again under its first step,
  accumulates the gradients in fp32 and passes the keys' and values' gradients (fp32)
  to the next rank after each step, hidden under the next step but the last.

Units: bytes and seconds per micro-batch on one rank; ``q_elements`` and ``kv_elements``
are the rank's local queries' and keys-plus-values' elements.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.communication import Collective, LinkModel, collective_time
from planner.cost.options import CpAttention
from planner.dtypes import FP32_BYTES

__all__ = ["CpKernels", "cp_kernels", "cp_exposed_comm", "cp_saved_bytes", "cp_mask_bytes"]

_CHUNKS = 2  # a rank's load-balanced chunks of every sequence


@dataclass(frozen=True)
class CpKernels:
    """How a rank's attention runs under context parallelism.

    ``work_fraction``: the kernel's work over its queries' whole scores against every key
    (causal skipping included); ``causal_kernel``: the kernel skips masked blocks;
    ``calls``: attention kernels per forward (backward twice); ``forward_bytes`` and
    ``backward_bytes``: memory-bound traffic beside the kernels; ``eager_ops``: operators
    beside the kernels, each paying an eager framework's per-operator overhead.
    """

    work_fraction: float
    causal_kernel: bool
    calls: int
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    eager_ops: int = 0


def cp_kernels(
    impl: CpAttention, cp: int, causal: bool, q_elements: float, kv_elements: float,
    element_bytes: int, *, masked: bool = False,
) -> CpKernels:  # fmt: skip
    """The attention kernels, their work and the traffic beside them (module docstring);
    ``masked``: the model hands the kernel a mask tensor, so it skips no block."""
    skips = causal and not masked
    whole = 0.5 if skips else 1.0
    if cp == 1:
        return CpKernels(whole, skips, 1)
    e, f = element_bytes, FP32_BYTES
    if impl is CpAttention.ALL_GATHER:
        if not causal:
            return CpKernels(1.0, False, 1, eager_ops=2)
        gathered = cp * kv_elements * e
        # sequence order: one copy of the gathered keys and values; the chunks' outputs
        # joined (one copy); backward the same traffic twice
        forward = 2 * gathered + 2 * q_elements * e
        work = (2 * cp + 1) / (4 * cp)
        return CpKernels(work, False, _CHUNKS, forward, 2 * forward, eager_ops=12)
    n, m = q_elements, kv_elements
    # per merged step: the block's cast to fp32, out - block, sigmoid * (...), out - (...),
    # a partial step's concatenation (half the steps); each step also joins K and V
    merge = (e + f) * n + 3 * f * n + 2 * f * n + 3 * f * n + f * n + 2 * e * m
    forward = (e + f) * n + (cp - 1) * merge + (f + e) * n
    # per step: grad_query += (fp32), the K/V gradients' accumulation and joining (fp32),
    # K and V joined for rotation; at the end both cast back
    step = (2 * f + e) * n + (2 * f + e) * m + 2 * f * m + 2 * e * m
    backward = cp * step + (f + e) * (n + m)
    return CpKernels(whole, skips, cp, forward, backward, eager_ops=8 * cp)


def cp_exposed_comm(
    impl: CpAttention, cp: int, kv_elements: float, element_bytes: int,
    attention: tuple[float, float], link: LinkModel,
) -> tuple[float, float]:  # fmt: skip
    """Exposed (forward, backward) seconds of one attention's K/V exchange; ``attention``
    is its (forward, backward) kernel seconds."""
    if cp == 1:
        return 0.0, 0.0
    kv_gathered = cp * kv_elements * element_bytes
    if impl is CpAttention.ALL_GATHER:
        # keys, then values at once, blocking both ways: the values' call waits for no
        # straggler after compute (the link's call_s, once per pair)
        gather = 2 * collective_time(Collective.ALL_GATHER, kv_gathered / 2, cp, link)
        scatter = 2 * collective_time(Collective.REDUCE_SCATTER, kv_gathered / 2, cp, link)
        return gather - link.call_s, scatter - link.call_s
    forward, backward = (seconds / cp for seconds in attention)  # one step's kernel
    gather = collective_time(Collective.ALL_GATHER, kv_gathered, cp, link)
    passed = collective_time(Collective.SEND_RECV, kv_elements * FP32_BYTES, 2, link)
    exposed_backward = max(gather - backward, 0.0) + (cp - 1) * max(passed - backward, 0.0) + passed
    return max(gather - forward, 0.0), exposed_backward


def cp_saved_bytes(impl: CpAttention, cp: int, kv_elements: float, element_bytes: int) -> float:
    """Bytes one attention keeps for backward beyond its local keys and values."""
    if cp == 1 or impl is not CpAttention.ALL_GATHER:
        return 0.0
    return (cp - 1) * kv_elements * element_bytes


def cp_mask_bytes(impl: CpAttention, cp: int, causal: bool, local_tokens: int) -> float:
    """Bytes of the causal masks kept for a sequence of ``local_tokens`` on one rank
    (boolean, one per chunk shape, shared by every layer)."""
    if cp == 1 or not causal or impl is not CpAttention.ALL_GATHER:
        return 0.0
    size = local_tokens / _CHUNKS
    # the chunks see (index + 1) and (2 cp - index) chunks of keys: 2 cp + 1 in all
    return size * size * (2 * cp + 1)
