"""Context-parallel attention priced as each implementation runs it."""

from dataclasses import replace

import pytest
import torch

from planner.cost.build import build_cost_model, spec_graph
from planner.cost.communication import Collective, collective_time, link_for_axis
from planner.cost.context_parallel import (
    cp_exposed_comm,
    cp_kernels,
    cp_mask_bytes,
    cp_saved_bytes,
)
from planner.cost.options import CostOptions, CpAttention
from planner.frameworks import KERNELS, Framework, framework_options
from planner.hardware import load_profile
from planner.presets import get_preset
from planner.spec import Cluster, Strategy, Training
from strategies.context_parallel import sequence_slice

H100 = load_profile("h100-sxm-80gb")
GATHER, RING = CpAttention.ALL_GATHER, CpAttention.RING
LINK = link_for_axis(8, 1, Cluster(gpu="h100-sxm-80gb", num_gpus=8, gpus_per_node=8), H100)


@pytest.mark.parametrize("impl", list(CpAttention))
def test_without_context_parallelism_both_run_one_kernel_and_exchange_nothing(impl) -> None:
    assert cp_kernels(impl, 1, True, 1e6, 2e6, 2) == cp_kernels(impl, 1, True, 0, 0, 2)
    kernels = cp_kernels(impl, 1, True, 1e6, 2e6, 2)
    assert (kernels.work_fraction, kernels.calls, kernels.forward_bytes) == (0.5, 1, 0.0)
    assert cp_exposed_comm(impl, 1, 2e6, 2, (1.0, 2.0), LINK) == (0.0, 0.0)
    assert cp_saved_bytes(impl, 1, 2e6, 2) == cp_mask_bytes(impl, 1, True, 4096) == 0.0


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_a_mask_tensor_makes_every_kernel_compute_every_block(cp: int) -> None:
    """A causal model that hands its attention a mask skips nothing; the runtime's
    gathered chunks already compute their key prefixes whole."""
    masked = cp_kernels(RING, cp, True, 1e6, 2e6, 2, masked=True)
    assert masked.work_fraction == 1.0 and not masked.causal_kernel
    gathered = cp_kernels(GATHER, cp, True, 1e6, 2e6, 2, masked=True)
    assert gathered == (masked if cp == 1 else cp_kernels(GATHER, cp, True, 1e6, 2e6, 2))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_runtime_computes_its_chunks_over_their_key_prefixes_whole(cp: int) -> None:
    """Chunks of n tokens: a rank's two chunks see (i + 1) and (2 cp - i) chunks of keys,
    (2 cp + 1) n^2 scores out of its 2 n x 2 cp n."""
    kernels = cp_kernels(GATHER, cp, True, 1e6, 2e6, 2)
    assert kernels.work_fraction == pytest.approx((2 * cp + 1) / (4 * cp))
    assert not kernels.causal_kernel and kernels.calls == 2
    assert kernels.forward_bytes > 0 and kernels.backward_bytes == 2 * kernels.forward_bytes
    full = cp_kernels(GATHER, cp, False, 1e6, 2e6, 2)
    assert (full.work_fraction, full.calls, full.forward_bytes) == (1.0, 1, 0.0)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_ring_runs_cp_causal_steps_and_merges_in_fp32(cp: int) -> None:
    kernels = cp_kernels(RING, cp, True, 1e6, 2e6, 2)
    assert kernels.work_fraction == 0.5 and kernels.causal_kernel and kernels.calls == cp
    more = cp_kernels(RING, 2 * cp, True, 1e6, 2e6, 2)
    assert more.forward_bytes > kernels.forward_bytes  # a merge per step beyond the first
    assert more.backward_bytes > kernels.backward_bytes


def test_the_runtime_waits_for_its_gathers_and_the_ring_hides_them_under_its_steps() -> None:
    cp, kv, e = 4, 8e6, 2
    gathered = cp * kv * e
    blocking = cp_exposed_comm(GATHER, cp, kv, e, (10.0, 20.0), LINK)
    gather = 2 * collective_time(Collective.ALL_GATHER, gathered / 2, cp, LINK)
    scatter = 2 * collective_time(Collective.REDUCE_SCATTER, gathered / 2, cp, LINK)
    assert blocking == pytest.approx((gather, scatter))  # LINK pays no call overhead
    waits = replace(LINK, call_s=1e-3)
    paired = cp_exposed_comm(GATHER, cp, kv, e, (10.0, 20.0), waits)
    assert paired == pytest.approx((gather + 1e-3, scatter + 1e-3))  # one wait per pair
    hidden = cp_exposed_comm(RING, cp, kv, e, (10.0, 20.0), LINK)
    last_pass = collective_time(Collective.SEND_RECV, kv * 4, 2, LINK)
    assert hidden == pytest.approx((0.0, last_pass))  # only the last gradient pass shows
    bare = cp_exposed_comm(RING, cp, kv, e, (0.0, 0.0), LINK)
    assert bare[0] == pytest.approx(collective_time(Collective.ALL_GATHER, gathered, cp, LINK))


def test_the_runtime_keeps_the_gathered_keys_and_values_and_its_masks() -> None:
    assert cp_saved_bytes(GATHER, 4, 1e6, 2) == 3 * 1e6 * 2
    assert cp_saved_bytes(RING, 4, 1e6, 2) == 0.0
    # chunks of 512 tokens under cp 4: 512 x 512 booleans for each of 2 cp + 1 = 9 blocks
    assert cp_mask_bytes(GATHER, 4, True, 1024) == 512 * 512 * 9
    assert cp_mask_bytes(GATHER, 4, False, 1024) == cp_mask_bytes(RING, 4, True, 1024) == 0.0


def _estimate(options: CostOptions, cp: int):
    spec = get_preset("llama3-8b").model_copy(update={"seq_len": 32768})
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=8, gpus_per_node=8)
    training = Training(global_batch_size=8 // cp, seq_len=spec.seq_len)
    graph = spec_graph(spec, training, options)
    model = build_cost_model(graph, cluster, training, causal=True, options=options)
    return model.estimate(Strategy(dp=8 // cp, cp=cp, zero=3, recompute="full"))


def test_this_runtime_prices_its_own_context_parallel_attention() -> None:
    planner = framework_options(Framework.PLANNER, CostOptions())
    assert planner.cp_attention is GATHER and CostOptions().cp_attention is RING
    assert "cp_attention" not in KERNELS[Framework.TORCHTITAN]
    ring, gather = _estimate(CostOptions(), 4), _estimate(planner, 4)
    assert gather.breakdown_s["comm_cp"] > ring.breakdown_s["comm_cp"]
    assert gather.step_time_s > ring.step_time_s
    # without context parallelism the two are the same run
    assert _estimate(CostOptions(), 1).step_time_s == pytest.approx(
        _estimate(planner.model_copy(update={"cp_attention": RING}), 1).step_time_s
    )


@pytest.mark.parametrize("cp", [2, 4])
def test_sequence_order_undoes_the_load_balanced_gather(cp: int) -> None:
    from strategies.context_parallel import _Shard

    sequence = torch.arange(2 * cp * 3).view(1, 1, -1, 1).float()  # (batch, heads, seq, dim)
    by_rank = [sequence_slice(sequence.transpose(1, 2), r, cp).transpose(1, 2) for r in range(cp)]
    shard = _Shard(0, cp, group=None)  # type: ignore[arg-type]
    assert torch.equal(shard.in_sequence_order(torch.cat(by_rank, dim=-2)), sequence)
