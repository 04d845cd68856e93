"""Hardware profiles: what one accelerator (and the links around it) can do.

A :class:`HardwareProfile` is JSON data with provenance: every number carries a source
(a datasheet figure, an nccl-tests issue, or a measurement and its date) in the
``sources`` mapping, keyed by the field's dotted path (``"links.intra_node.bandwidth_GBps"``).
Profiles ship in the top-level ``profiles`` package and load by name; calibration
writes new ones with the same schema (a CPU "device" with gloo links is a profile too).

Units: ``_tflops`` 10^12 FLOP/s (dense), ``_GBps`` 10^9 bytes/s per device in one
direction, ``_us`` microseconds, ``_gib`` 2^30 bytes; efficiencies are fractions.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from planner.errors import SpecError, UnknownNameError
from planner.io import dumps_json, write_text_atomic
from planner.spec import Bandwidth, DType, Floor, Latency, Limit, NodeSize, load_document

__all__ = [
    "PROFILE_SCHEMA_VERSION",
    "MAX_FACTOR",
    "PEAK_LIMIT",
    "CollectiveName",
    "Protocol",
    "Link",
    "HardwareProfile",
    "list_profiles",
    "profile_dir",
    "load_profile",
    "save_profile",
    "numbers",
]

PROFILE_SCHEMA_VERSION: Literal[1] = 1
MAX_FACTOR = 10.0  # largest collective bus-bandwidth factor against the ring's

# Every number is finite and in a range whose products and quotients stay finite: a peak
# of 0 would divide by zero, a negative one gives a negative MFU.
_PEAK_FLOOR = Floor(1e-6, "a peak must be positive (1e-06 TFLOP/s is a megaFLOP/s)")
PEAK_LIMIT = Limit(1e6, "more than an exaFLOP/s per device: no accelerator is that fast")
_FRACTION_FLOOR = Floor(1e-6, "an efficiency is a fraction of the peak, in (0, 1]")
_CAPACITY_FLOOR = Floor(1e-3, "a memory capacity must be positive (1e-03 GiB is 1 MiB)")
_CAPACITY_LIMIT = Limit(1e9, "more than an exbibyte per device")
PeakTflops = Annotated[float, AfterValidator(_PEAK_FLOOR), AfterValidator(PEAK_LIMIT)]
Fraction = Annotated[float, Field(le=1), AfterValidator(_FRACTION_FLOOR)]
Capacity = Annotated[float, AfterValidator(_CAPACITY_FLOOR), AfterValidator(_CAPACITY_LIMIT)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# Collectives a link can carry (the values of planner.cost.communication.Collective)
CollectiveName = Literal[
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast"
]


class Protocol(_Frozen):
    """A low-latency wire protocol a collective library may pick for small messages
    (NCCL's LL and LL128): a fixed ``launch_us`` per call, ``hop_us`` per algorithm step,
    and ``bandwidth_share`` of the link's bus bandwidth (its flags ride in the payload)."""

    launch_us: Latency
    hop_us: Latency
    bandwidth_share: Fraction


class Link(_Frozen):
    """One link tier as collectives see it.

    ``bandwidth_GBps`` is the line rate per device, one direction; collectives reach
    ``busbw_efficiency`` of it for large messages (nccl-tests bus bandwidth). The bulk
    protocol pays ``launch_us`` once per call (None: 0; NCCL's Simple protocol fills its
    pipeline) and ``latency_us`` per algorithm step, which makes small messages
    latency-bound. ``protocols`` are the library's low-latency protocols; a collective
    runs on whichever of them and the bulk one is fastest for its size, which gives the
    bandwidth-over-size curve nccl-tests prints. ``collective_factors`` scales the bulk
    protocol's bus bandwidth for one collective against the ring's (NVLink SHARP
    all-reduces at 1.28x the ring's on H100; a library whose reduce-scatter reaches half
    the all-reduce's has 0.5); a collective not listed gets 1, as NCCL's ring does.
    An all-reduce may run as a tree (``2 ceil(log2 n)`` steps instead of the ring's
    ``2(n-1)``) at ``tree_bandwidth_share`` of the bandwidth (None: the ring's).
    ``multicast`` (scale-up link): the switch reduces in the network (NVLink SHARP,
    NCCL's NVLS), so an all-reduce across nodes may also run as NCCL's NVLS tree: reduced
    on the switch inside each node and over a tree of the NICs between nodes, at the
    slower of the switch's all-reduce rate and the network's (twice the network's over
    two nodes, where a node's NICs carry the array once each way).
    ``call_overhead_us`` is paid once per blocking collective call on top of its
    algorithm steps: the runtime's dispatch and, in training, the wait for the slowest
    rank after a stretch of compute, which a back-to-back sweep does not see (None: 0;
    ``plan calibrate --from`` fits it to measured runs).
    """

    bandwidth_GBps: Bandwidth
    latency_us: Latency
    busbw_efficiency: Fraction
    launch_us: Latency | None = None
    protocols: dict[str, Protocol] = {}
    tree_bandwidth_share: Fraction | None = None
    multicast: bool = False
    collective_factors: dict[CollectiveName, float] = {}
    call_overhead_us: Latency | None = None

    @model_validator(mode="after")
    def _positive_factors(self) -> Self:
        bad = {k: v for k, v in self.collective_factors.items() if not 0 < v <= MAX_FACTOR}
        if bad:
            raise ValueError(
                f"collective_factors {bad} must lie in (0, {MAX_FACTOR:g}]: a factor is a "
                "collective's bulk bus bandwidth relative to the ring's"
            )
        return self


class Links(_Frozen):
    intra_node: Link  # scale-up domain (NVLink, xGMI, shared memory)
    inter_node: Link  # scale-out network per device (InfiniBand, RoCE, TCP)


class HardwareProfile(_Frozen):
    """One device type: peak throughput, memory, efficiency curves and links.

    Matmul time for a GEMM of F FLOPs is ``F / (peak * matmul_efficiency) +
    matmul_overhead_us``: the efficiency saturates with problem size and is half the
    maximum at ``F = peak * matmul_efficiency * matmul_overhead_us`` (fp8 GEMMs at
    :meth:`matmul_efficiency_for`). Memory-bound
    operators move bytes at ``memory_bandwidth_GBps * memory_efficiency`` plus
    ``kernel_overhead_us`` each.

    Eager framework time, which a bare kernel call does not pay (a calibrated CPU
    profile has it; ``None``: 0, as on GPUs, whose kernels queue ahead of the host):
    ``op_overhead_us`` per operator of the priced graph (dispatch, autograd, Python
    between operators), once in its forward and twice in its backward;
    ``param_overhead_us`` per parameter tensor per optimizer step (the optimizer's own
    kernels per tensor, gradient clipping and zeroing). What only the runtime's
    distributed wrappers pay beyond that (measured by ``plan calibrate``'s probe plans):
    ``dtensor_op_overhead_us`` per operator a tensor-parallel layout shards (DTensor's
    dispatch and redistribution, once forward and twice backward),
    ``dtensor_param_overhead_us`` per parameter tensor held as a DTensor (sharded by
    FSDP2 or tensor parallelism) per optimizer step, and ``fsdp_call_overhead_us`` per
    FSDP2 unit's all-gather or reduce-scatter (its hooks and copies in and out);
    ``step_overhead_us`` per optimizer step (the training loop's own time: the loss's
    host sync, zeroing, Python between phases) and ``pipeline_step_overhead_us`` more per
    pipeline schedule run (its set-up: splitting the batch, checks, merging the losses).
    """

    schema_version: Literal[1] = PROFILE_SCHEMA_VERSION
    name: str
    description: str = ""
    device_kind: Literal["gpu", "cpu"] = "gpu"
    peak_tflops: dict[DType, PeakTflops]  # dense matrix throughput per dtype
    matmul_efficiency: Fraction  # large GEMMs in training, fraction of peak
    matmul_overhead_us: Latency  # fixed cost per GEMM (launch, tail waves)
    fp8_matmul_ratio: Fraction | None = None  # fp8 GEMMs' efficiency over bf16's (None: 1)
    # a GEMM with fewer output columns (PowerSGD's rank-r products) runs as if it had
    # this many: the BLAS kernel's panel (None: at its own width)
    narrow_matmul_width: Annotated[float, Field(ge=1.0)] | None = None
    attention_efficiency: Fraction  # fused (flash) attention, of peak: FlashAttention-2
    # cuDNN's fused attention (Transformer Engine's choice on Hopper and later), of peak
    # (None: as attention_efficiency)
    cudnn_attention_efficiency: Fraction | None = None
    memory_capacity_gib: Capacity  # usable by the framework
    memory_bandwidth_GBps: Bandwidth
    memory_efficiency: Fraction  # achieved fraction for streaming ops
    kernel_overhead_us: Latency  # fixed cost per memory-bound kernel
    op_overhead_us: Latency | None = None  # eager framework time per operator (forward)
    param_overhead_us: Latency | None = None  # eager optimizer time per parameter tensor
    dtensor_op_overhead_us: Latency | None = None  # per tensor-parallel sharded operator (forward)
    dtensor_param_overhead_us: Latency | None = None  # per DTensor parameter per optimizer step
    fsdp_call_overhead_us: Latency | None = None  # per FSDP2 unit gather or reduce-scatter
    step_overhead_us: Latency | None = None  # the training loop's own time per step
    pipeline_step_overhead_us: Latency | None = None  # per pipeline schedule run
    gpus_per_node: NodeSize
    links: Links
    sources: dict[str, str]

    @model_validator(mode="after")
    def _every_number_has_a_source(self) -> Self:
        missing = sorted(set(self.numeric_fields()) - set(self.sources))
        if missing:
            raise ValueError(
                f"profile {self.name!r} has numbers without a source: {', '.join(missing)}; "
                "add them to 'sources' (datasheet, nccl-tests issue, or 'measured <date>')"
            )
        return self

    def numeric_fields(self) -> list[str]:
        """Dotted paths of every number in the profile (what ``sources`` must cover)."""
        data = self.model_dump(mode="json", exclude={"sources", "schema_version"})
        return [path for path, _ in numbers(data)]

    def peak_flops(self, dtype: DType) -> float:
        """Dense matrix FLOP/s for ``dtype`` (raises :class:`SpecError` if the profile lacks it)."""
        if dtype not in self.peak_tflops:
            known = ", ".join(sorted(d.value for d in self.peak_tflops))
            raise SpecError(
                f"profile {self.name!r} has no peak_tflops for dtype {dtype.value!r} "
                f"(it has: {known}); train in one of those (training.dtype; plan --dtype) or "
                "add the figure to the profile's peak_tflops"
            )
        return self.peak_tflops[dtype] * 1e12

    def matmul_efficiency_for(self, dtype: DType) -> float:
        """The fraction of ``dtype``'s peak large GEMMs reach in training: fp8 GEMMs reach
        ``fp8_matmul_ratio`` of bf16's efficiency (Hopper's fp8 tensor cores do not
        double bf16's throughput at training shapes), where the profile gives it."""
        if dtype is DType.FP8 and self.fp8_matmul_ratio is not None:
            return self.matmul_efficiency * self.fp8_matmul_ratio
        return self.matmul_efficiency

    @property
    def memory_capacity_bytes(self) -> float:
        return self.memory_capacity_gib * 2**30


def numbers(data: object, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted path, value) of every number (not a bool) in nested dicts ``data``."""
    if isinstance(data, dict):
        items: list[tuple[str, float]] = []
        for key, value in data.items():
            items.extend(numbers(value, f"{prefix}.{key}" if prefix else str(key)))
        return items
    if isinstance(data, int | float) and not isinstance(data, bool):
        return [(prefix, float(data))]
    return []


def profile_dir() -> Path:
    """The folder of the shipped profiles (GPU profiles; cluster profiles in clusters/)."""
    return Path(str(resources.files("profiles")))


def list_profiles() -> list[str]:
    """Names of the profiles shipped in the ``profiles`` package."""
    return sorted(path.stem for path in profile_dir().glob("*.json"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """Load a shipped profile by name (``a100-sxm-80gb``) or a profile JSON file by path.

    Raises :class:`UnknownNameError` listing the shipped profiles for an unknown name.
    """
    path = Path(name_or_path)
    if name_or_path.endswith(".json") or path.is_file():
        return load_document(HardwareProfile, path)  # the message names a missing file
    shipped = profile_dir() / f"{name_or_path}.json"
    if not shipped.is_file():
        raise UnknownNameError("GPU profile", name_or_path, list_profiles())
    return load_document(HardwareProfile, shipped)


def save_profile(profile: HardwareProfile, path: Path) -> None:
    """Write ``profile`` as JSON atomically (temporary file, then rename)."""
    text = dumps_json(profile.model_dump(mode="json"), what=f"hardware profile {path}")
    write_text_atomic(path, text + "\n")
