"""Turn microbenchmark samples into a :class:`~planner.hardware.HardwareProfile`.

Fitted numbers replace the base profile's (datasheet) ones and say so in ``sources``
("measured <date> on <host>: <method>"). Without a base profile (a CPU), the peak GEMM
rate is estimated from the clock and vector width and the memory bandwidth is the
achieved streaming rate (efficiency 1); both sources say how they were obtained.

On a CPU the eager framework time comes from a timed training step of a zoo model
(:class:`~planner.calibrate.fit.StepSample`): what its forward and backward took beyond
the cost model's price of its operators on the fitted profile, per operator (once
forward, twice backward: ``op_overhead_us``), and what its optimizer step took beyond
the price of its memory traffic, per parameter tensor (``param_overhead_us``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.calibrate.fit import (
    Array,
    Bound,
    CalibrationError,
    FitResult,
    Sample,
    StepSample,
    fit_alpha_beta,
    fit_matmul,
    fit_memory,
    fit_parameters,
    fit_streaming,
    rms,
)
from planner.calibrate.links import LinkSample, fit_tier
from planner.calibrate.options import measured_run_options
from planner.cost.build import build_cost_model, spec_graph
from planner.cost.communication import Collective
from planner.hardware import HardwareProfile
from planner.presets import get_preset
from planner.spec import Cluster, DType, Strategy, Training

__all__ = ["Measurements", "CalibrationReport", "build_profile", "cpu_peak_tflops", "ram_gib"]


@dataclass(frozen=True)
class Measurements:
    """Everything one ``plan calibrate`` run measured on one device type."""

    dtype: DType
    matmul: Sequence[Sample]
    memory: Sequence[Sample]
    attention: Sequence[Sample]
    collectives: Sequence[tuple[Collective, int, float, float]]  # kind, ranks, bytes, seconds
    ranks_per_node: int
    step: StepSample | None = None  # an eager training step (CPUs)
    narrow_matmul: Sample | None = None  # a GEMM with a narrow output (CPUs)


@dataclass(frozen=True)
class CalibrationReport:
    """The fits behind a profile, for printing: name -> fit."""

    fits: dict[str, FitResult]


def cpu_peak_tflops(threads: int, gemms: Sequence[Sample] = ()) -> tuple[float, str]:
    """Dense fp32 peak of ``threads`` CPU cores from /proc/cpuinfo, and how it was derived.

    FLOPs per cycle per core: 64 with AVX-512 (two 512-bit FMA units), 32 with AVX2+FMA,
    8 otherwise; times the reported clock. A VM reports its nominal clock, which turbo
    exceeds: when the GEMMs timed in ``gemms`` reached a higher rate (fitted, launch
    overhead removed), that rate is the peak.
    """
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    mhz = re.search(r"cpu MHz\s*:\s*([\d.]+)", text)
    found = re.search(r"flags\s*:\s*(.*)", text)
    flags = set(found.group(1).split()) if found else set()
    if mhz is None:
        raise CalibrationError(
            "cannot read the CPU clock from /proc/cpuinfo to estimate the peak: pass "
            "--peak-tflops (fp32 TFLOP/s per rank)"
        )
    per_cycle = 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 8
    tflops = float(mhz.group(1)) * 1e6 * per_cycle * threads / 1e12
    how = f"estimated: {float(mhz.group(1)):.0f} MHz x {per_cycle} fp32 FLOP/cycle x {threads} thread(s)"
    reached = _gemm_rate_tflops(gemms) if gemms else 0.0
    if reached > tflops:
        # 0.1% above the rate reached, so refitting against it gives an efficiency under 1
        return 1.001 * reached, (
            f"{how} = {tflops:.3g} TFLOP/s, raised to {reached:.3g} TFLOP/s, the rate the "
            "GEMM sweep reached (the clock runs above the one /proc/cpuinfo reports)"
        )
    return tflops, how


def _gemm_rate_tflops(gemms: Sequence[Sample]) -> float:
    """The GEMM rate ``gemms`` reached, launch overhead removed (TFLOP/s)."""
    trial = 10 * max(s.work / s.seconds for s in gemms)  # any peak the fit stays below
    fitted = fit_matmul([s.work for s in gemms], [s.seconds for s in gemms], trial)
    return trial * fitted.values["matmul_efficiency"] / 1e12


def ram_gib(ranks_per_node: int) -> float:
    """This machine's physical memory in GiB, divided among ``ranks_per_node`` ranks."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / 2**30 / ranks_per_node


def _attention_fit(samples: Sequence[Sample], peak: float, gemm_overhead_s: float) -> FitResult:
    """Fit ``attention_efficiency``; each forward+backward pays three GEMM overheads."""
    work = np.array([s.work for s in samples])
    seconds = np.array([s.seconds for s in samples])

    def residuals(p: Array) -> Array:
        return np.log((work / (peak * p[0]) + 3 * gemm_overhead_s) / seconds)

    return fit_parameters(
        residuals, [0.3], [Bound("attention_efficiency", 1e-3, 1.0)],
        what="attention fit",
        hint="raise peak_tflops if attention ran faster than peak",
    )  # fmt: skip


def build_profile(
    measured: Measurements,
    *,
    name: str,
    stamp: str,
    device_kind: str,
    base: HardwareProfile | None,
    peak_tflops: float | None,
    peak_source: str,
    memory_capacity_gib: float,
) -> tuple[HardwareProfile, CalibrationReport]:
    """A profile whose efficiencies, overheads, bandwidths and links are fitted.

    ``stamp`` ("measured 2026-11-30 on host: ...") prefixes every fitted source.
    ``peak_tflops`` (per device, ``measured.dtype``) defaults to the base profile's.
    """
    dtype = measured.dtype
    if peak_tflops is None:
        if base is None or dtype not in base.peak_tflops:
            raise CalibrationError(
                f"no peak_tflops for {dtype.value}: pass --base PROFILE (a datasheet profile) "
                "or --peak-tflops"
            )
        peak_tflops, peak_source = base.peak_tflops[dtype], base.sources.get("peak_tflops", "")
    peak = peak_tflops * 1e12
    fits: dict[str, FitResult] = {}
    fits["matmul"] = fit_matmul([s.work for s in measured.matmul],
                                [s.seconds for s in measured.matmul], peak)  # fmt: skip
    gemm_overhead_s = fits["matmul"].values["matmul_overhead_us"] * 1e-6
    fits["attention"] = _attention_fit(measured.attention, peak, gemm_overhead_s)
    memory_fields = _memory_fields(measured, base, fits, stamp)
    sources = {
        "peak_tflops." + dtype.value: peak_source,
        "matmul_efficiency": f"{stamp}: GEMM sweep, least-squares fit",
        "matmul_overhead_us": f"{stamp}: GEMM sweep, least-squares fit",
        "attention_efficiency": f"{stamp}: causal SDPA forward+backward sweep, fit",
        "memory_capacity_gib": f"{stamp}: physical memory per rank",
        "gpus_per_node": f"{stamp}: ranks per node in the calibration run",
        **memory_fields[1],
    }
    links, link_sources = _links(measured, base, fits, stamp)
    sources.update(link_sources)
    peaks = dict(base.peak_tflops) if base is not None else {}
    peaks[dtype] = peak_tflops
    for other in peaks:
        if other is not dtype and base is not None:
            sources[f"peak_tflops.{other.value}"] = base.sources.get(
                f"peak_tflops.{other.value}", ""
            )
    profile = HardwareProfile.model_validate(
        {
            "name": name,
            "description": f"calibrated on {stamp.removeprefix('measured ')}",
            "device_kind": device_kind,
            "peak_tflops": {d.value: v for d, v in peaks.items()},
            "matmul_efficiency": fits["matmul"].values["matmul_efficiency"],
            "matmul_overhead_us": fits["matmul"].values["matmul_overhead_us"],
            "attention_efficiency": fits["attention"].values["attention_efficiency"],
            "memory_capacity_gib": memory_capacity_gib,
            **memory_fields[0],
            "gpus_per_node": measured.ranks_per_node,
            "links": links,
            "sources": sources,
        }
    )
    if measured.step is not None:
        profile = _with_framework_overheads(profile, measured.step, fits, stamp)
    if measured.narrow_matmul is not None:
        profile = _with_narrow_matmul_width(profile, measured.narrow_matmul, dtype, stamp)
    return profile, CalibrationReport(fits)


def _with_narrow_matmul_width(
    profile: HardwareProfile, narrow: Sample, dtype: DType, stamp: str
) -> HardwareProfile:
    """``profile`` with the output width its BLAS runs a narrow GEMM at: the columns
    that take the sample's time at the fitted ``dtype`` GEMM rate."""
    rate = profile.peak_flops(dtype) * profile.matmul_efficiency
    compute_s = max(0.0, narrow.seconds - profile.matmul_overhead_us * 1e-6)
    width = max(1.0, compute_s * rate / narrow.work)  # narrow.work: FLOPs per column
    source = (
        f"{stamp}: a {narrow.label.removeprefix('mm ')} GEMM's time at the fitted GEMM rate "
        "(the output width its kernel computes)"
    )
    return profile.model_copy(
        update={
            "narrow_matmul_width": round(width, 1),
            "sources": {**profile.sources, "narrow_matmul_width": source},
        }
    )


def _with_framework_overheads(
    profile: HardwareProfile, step: StepSample, fits: dict[str, FitResult], stamp: str
) -> HardwareProfile:
    """``profile`` with the eager framework time ``step`` measured beyond the cost
    model's price of the same step on ``profile`` (at least 0), priced as this runtime
    runs it (data parallel over the step's ranks, a for-loop AdamW): its forward and
    backward against the priced step but the optimizer's. The cost model prices both
    overheads linearly, so one trial at 1 us each gives their seconds per us."""
    spec = get_preset(step.model)
    batch = step.micro_batch * step.ranks
    training = Training(global_batch_size=batch, seq_len=spec.seq_len, dtype=DType.FP32)
    graph = spec_graph(spec, training)
    cluster = Cluster(gpu=profile.name, num_gpus=step.ranks, gpus_per_node=step.ranks)
    strategy = Strategy(dp=step.ranks, micro_batch_size=step.micro_batch)

    def priced(op_us: float, param_us: float) -> Array:
        """Seconds of the step's forward+backward and optimizer at these overheads."""
        trial = profile.model_copy(update={"op_overhead_us": op_us, "param_overhead_us": param_us})
        model = build_cost_model(
            graph, cluster, training, causal=spec.causal,
            options=measured_run_options(profile), profile=trial,
        )  # fmt: skip
        breakdown = model.estimate(strategy).breakdown_s
        optimizer = breakdown["optimizer"]
        return np.array([sum(breakdown.values()) - optimizer, optimizer])

    measured = np.array([step.forward_backward_s, step.optimizer_s])
    bare = priced(0.0, 0.0)
    op_us, param_us = np.maximum(measured - bare, 0.0) / (priced(1.0, 1.0) - bare)
    fits["framework"] = FitResult(
        {"op_overhead_us": float(op_us), "param_overhead_us": float(param_us)},
        rms(np.log(measured / bare)), rms(np.log(measured / priced(op_us, param_us))), 2,
    )  # fmt: skip
    where = "one process" if step.ranks == 1 else f"DDP over {step.ranks} processes"
    how = (
        f"{stamp}: eager training step of {step.model} ({step.micro_batch} sequences, fp32, "
        f"{where}): {step.forward_backward_s * 1e3:.2f} ms forward+backward, "
        f"{step.optimizer_s * 1e3:.2f} ms optimizer, beyond the cost model's price"
    )
    sources = {**profile.sources, "op_overhead_us": how, "param_overhead_us": how}
    return HardwareProfile.model_validate(
        {**profile.model_dump(), "op_overhead_us": float(op_us),
         "param_overhead_us": float(param_us), "sources": sources}
    )  # fmt: skip


def _memory_fields(
    measured: Measurements, base: HardwareProfile | None, fits: dict[str, FitResult], stamp: str
) -> tuple[dict[str, float], dict[str, str]]:
    work = [s.work for s in measured.memory]
    seconds = [s.seconds for s in measured.memory]
    how = f"{stamp}: elementwise multiply sweep, least-squares fit"
    if base is None:
        fits["memory"] = fit_streaming(work, seconds)
        values = {**fits["memory"].values, "memory_efficiency": 1.0}
        text = {"memory_efficiency": f"{stamp}: 1, memory_bandwidth_GBps is the achieved rate"}
        return values, {"memory_bandwidth_GBps": how, "kernel_overhead_us": how, **text}
    fits["memory"] = fit_memory(work, seconds, base.memory_bandwidth_GBps * 1e9)
    values = {**fits["memory"].values, "memory_bandwidth_GBps": base.memory_bandwidth_GBps}
    source = base.sources.get("memory_bandwidth_GBps", "")
    return values, {"memory_efficiency": how, "kernel_overhead_us": how,
                    "memory_bandwidth_GBps": source}  # fmt: skip


def _links(
    measured: Measurements, base: HardwareProfile | None, fits: dict[str, FitResult], stamp: str
) -> tuple[dict[str, object], dict[str, str]]:
    """Intra-node link from the collective fit; inter-node kept from the base (or copied).
    A base link with NCCL's protocols gets its curve refitted (:func:`_curve_links`)."""
    if not measured.collectives:
        if base is None:
            raise CalibrationError(
                "no collectives were measured (a single process) and there is no base profile "
                "for the links: run under torchrun with 2 or more ranks, or pass --base"
            )
        sources = {k: v for k, v in base.sources.items() if k.startswith("links.")}
        return base.links.model_dump(), sources
    if base is not None and base.links.intra_node.protocols:
        return _curve_links(measured, base, fits, stamp)
    fit = fits["collectives"] = fit_alpha_beta(measured.collectives, factors=True)
    factors = {
        name.removeprefix("factor."): value
        for name, value in fit.values.items()
        if name.startswith("factor.")
    }
    intra = {
        "bandwidth_GBps": fit.values["busbw_GBps"],
        "latency_us": fit.values["latency_us"],
        "busbw_efficiency": 1.0,
        "collective_factors": factors,
    }
    how = f"{stamp}: collective sweep over the process group, alpha-beta fit"
    sources = {
        "links.intra_node.bandwidth_GBps": how + " (achieved all-reduce bus bandwidth)",
        "links.intra_node.latency_us": how,
        "links.intra_node.busbw_efficiency": f"{stamp}: 1, bandwidth_GBps is the achieved busbw",
    }
    for kind in factors:
        sources[f"links.intra_node.collective_factors.{kind}"] = (
            f"{how} (bus bandwidth of {kind} over all-reduce's)"
        )
    if base is not None:
        inter = base.links.inter_node.model_dump()
        sources.update({k: v for k, v in base.sources.items() if k.startswith("links.inter_node")})
    else:
        inter = dict(intra)
        for path in [k for k in sources if k.startswith("links.intra_node.")]:
            sources[path.replace("intra_node", "inter_node", 1)] = (
                f"{stamp}: copy of intra_node (one host measured, no network)"
            )
    return {"intra_node": intra, "inter_node": inter}, sources


def _curve_links(
    measured: Measurements, base: HardwareProfile, fits: dict[str, FitResult], stamp: str
) -> tuple[dict[str, object], dict[str, str]]:
    """The base's links with the tier the sweep ran on (one node: the scale-up link; under
    torchrun across nodes: the network) fitted to NCCL's protocol curve."""
    samples = [
        LinkSample(kind, ranks, measured.ranks_per_node, size, seconds)
        for kind, ranks, size, seconds in measured.collectives
    ]
    how = f"{stamp}: collective sweep over the process group, NCCL protocol curve fit"
    fitted, fits["collectives"], _ = fit_tier(base, samples, samples[0].tier, how)
    sources = {k: v for k, v in fitted.sources.items() if k.startswith("links.")}
    return fitted.links.model_dump(), sources
