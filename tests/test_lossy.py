"""Compression-aware search: lossy options only when allowed, only where they run and pay."""

from pathlib import Path

import pytest

from planner.assemble import assemble_plan
from planner.cli import main
from planner.clusters import list_clusters, load_cluster, resolve_cluster
from planner.cost import CostModel, graph_from_spec
from planner.cost.communication import link_for_axis
from planner.errors import SpecError, UnknownNameError
from planner.hardware import load_profile, profile_dir
from planner.models import ModelHandle, build, get_preset, resolve_model
from planner.modules import check_model_against_plan
from planner.parallel_dims import ParallelDims
from planner.planning import make_plan
from planner.solve.lossy import (
    LossyCompression,
    compression_blocker,
    crossover_bandwidth,
    decode,
    encode,
)
from planner.solve.search import ModelLimits, Pins, search
from planner.spec import (
    Axis,
    Cluster,
    Compression,
    CompressionKind,
    DType,
    LinkTier,
    Plan,
    Strategy,
    Training,
)

ALL = LossyCompression.parse("bf16,int8,powersgd:4,local_sgd:8")
SPEC = get_preset("gpt3-1.3b")
LIMITS = ModelLimits(SPEC.num_layers, SPEC.seq_len, SPEC.num_heads, SPEC.kv_heads)


def _model(inter_node_GBps: float, gpus: int = 16) -> CostModel:
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=gpus, inter_node_GBps=inter_node_GBps)
    return CostModel(graph_from_spec(SPEC), cluster, Training(global_batch_size=64))


def _chosen(inter_node_GBps: float, lossy: LossyCompression | None = ALL) -> Strategy:
    return search(_model(inter_node_GBps), LIMITS, top_k=1, lossy=lossy).best.strategy


def test_parse_defaults_items_and_errors():
    default = LossyCompression.parse("")
    assert default == LossyCompression(half=True, int8=True, powersgd_ranks=(4,))
    assert LossyCompression.parse("default") == default
    parsed = LossyCompression.parse("fp16, powersgd:2,powersgd:8,local_sgd:16,local_sgd")
    assert parsed == LossyCompression(True, False, (2, 8), (8, 16))
    assert not LossyCompression().allows_any
    for bad, named in [("topk", "'topk'"), ("powersgd:0", "powersgd:0"), ("local_sgd:1", ">= 2")]:
        with pytest.raises(SpecError, match=named):
            LossyCompression.parse(bad)


def test_keys_only_on_meshes_the_runtime_runs():
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=16)

    def kinds(**mesh):
        keys = ALL.keys(cluster, DType.BF16, **mesh)
        return [decode(k).describe() for k in keys]

    ddp = kinds(dp=16, tp=1, pp=1, cp=1, zero=0)
    assert ddp == ["none", "bf16", "powersgd(r4)", "local_sgd(H8,g8)"]
    assert kinds(dp=8, tp=2, pp=1, cp=1, zero=3) == ["none", "bf16", "int8"]  # FSDP
    assert kinds(dp=8, tp=2, pp=1, cp=1, zero=0) == [
        "none",
        "bf16",
        "powersgd(r4)",
        "local_sgd(H8,g4)",
    ]
    assert kinds(dp=8, tp=1, pp=2, cp=1, zero=0) == ["none"]  # no DDP hook with pipelines
    assert kinds(dp=1, tp=16, pp=1, cp=1, zero=0) == ["none"]  # nothing to reduce
    assert list(LossyCompression().keys(cluster, DType.BF16, dp=16, tp=1, pp=1, cp=1, zero=0)) == [
        encode(Compression())
    ]
    fp16 = ALL.keys(cluster, DType.FP16, dp=16, tp=1, pp=1, cp=1, zero=0)
    assert decode(list(fp16)[1]).kind is CompressionKind.FP16


def test_keys_round_trip_and_lossy_warmup():
    for compression in (
        Compression(),
        Compression(kind="bf16"),
        Compression(kind="powersgd", rank=4, warmup_steps=1000),
        Compression(kind="local_sgd", period=8, local_group=8, warmup_steps=1000),
    ):
        assert decode(encode(compression)) == compression


def test_no_lossy_compression_unless_allowed():
    for bandwidth in (50.0, 1.0, 0.03):
        assert _chosen(bandwidth, lossy=None).compression.kind is CompressionKind.NONE


@pytest.mark.slow  # dozens of searches
def test_the_search_switches_none_then_bf16_then_powersgd_as_links_slow():
    kinds = [_chosen(bandwidth).compression.kind for bandwidth in (50.0, 3.0, 0.3)]
    assert kinds == [CompressionKind.NONE, CompressionKind.BF16, CompressionKind.POWERSGD]
    fast, slow = _model(50.0), _model(0.3)
    exact = search(slow, LIMITS, top_k=1).best.prediction.step_time_s
    lossy = search(slow, LIMITS, top_k=1, lossy=ALL).best.prediction
    assert lossy.step_time_s < 0.7 * exact  # it pays where it is chosen
    assert lossy.breakdown_s["compression"] > 0  # and its compute is priced
    assert search(fast, LIMITS, top_k=1, lossy=ALL).best.prediction.breakdown_s.get(
        "compression", 0.0
    ) == pytest.approx(0.0)


@pytest.mark.slow  # dozens of searches
def test_crossover_bandwidth_brackets_the_switch():
    only_powersgd = LossyCompression(powersgd_ranks=(4,))

    def picks(bandwidth: float) -> bool:
        return _chosen(bandwidth, only_powersgd).compression.kind is CompressionKind.POWERSGD

    crossover = crossover_bandwidth(picks, 0.01, 50.0, steps=8)
    assert crossover is not None and 0.01 < crossover < 50.0
    assert picks(crossover * 0.9) and not picks(crossover * 1.2)
    assert crossover_bandwidth(lambda b: False, 0.01, 50.0) is None
    assert crossover_bandwidth(lambda b: True, 0.01, 50.0) == 50.0


def test_pinned_compression_must_be_allowed():
    pins = Pins(compression=Compression(kind="powersgd", rank=4, warmup_steps=1000))
    with pytest.raises(SpecError, match="--allow-lossy-compression powersgd:4"):
        search(_model(1.0), LIMITS, pins=pins)
    allowed = LossyCompression.allowing(pins.compression)
    best = search(_model(1.0), LIMITS, pins=pins, lossy=allowed).best.strategy
    assert best.compression == pins.compression


def test_a_pinned_compression_runs_only_where_parallel_dims_allows_it():
    """The search keeps a pinned option only on meshes the runtime runs it on, and says
    why when none is left."""
    pins = Pins(zero=3, compression=Compression(kind="powersgd", rank=4, warmup_steps=1000))
    allowed = LossyCompression.allowing(pins.compression)
    with pytest.raises(
        SpecError, match=r"compression.kind = 'powersgd' with zero = 3: .* use zero = 0"
    ):
        search(_model(1.0), LIMITS, pins=pins, lossy=allowed)
    local = Compression(kind="local_sgd", period=8, local_group=3, warmup_steps=1000)
    with pytest.raises(SpecError, match=r"local_group = 3 with dp\(16\)"):
        search(_model(1.0), LIMITS, pins=Pins(dp=16, compression=local), lossy=ALL)


def test_compression_blocker_asks_parallel_dims_for_the_local_group():
    ddp = ParallelDims(dp=8)
    assert compression_blocker(Compression(kind="bf16"), ddp) is None
    odd = Compression(kind="local_sgd", period=8, local_group=3)
    assert compression_blocker(odd, ddp) == ddp.local_sgd_blocker(3)
    fsdp = ParallelDims(dp=8, zero=2, dp_shard=8)
    assert compression_blocker(odd, fsdp) == fsdp.compression_blocker(CompressionKind.LOCAL_SGD)


def test_keys_use_the_sharding_they_are_given():
    """int8 replaces FSDP's reduce-scatter: with ZeRO over one rank (dp 1, cp 2 gives
    two) it needs ranks to shard over, whatever dp_shard's default."""
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=16)
    hybrid = ALL.keys(cluster, DType.BF16, dp=8, tp=2, pp=1, cp=1, zero=2, dp_shard=4)
    assert [decode(k).describe() for k in hybrid] == ["none", "bf16", "int8"]
    single = ALL.keys(cluster, DType.BF16, dp=1, tp=8, pp=1, cp=2, zero=2, dp_shard=1)
    assert "int8" in [decode(k).describe() for k in single]


def test_powersgd_rank_larger_than_the_matrices_is_refused():
    model = _model(1.0)
    strategy = Strategy(
        dp=16, micro_batch_size=4, compression=Compression(kind="powersgd", rank=2048)
    )
    with pytest.raises(SpecError, match=r"compression.rank = 2048 .* rank <= \d+"):
        model.estimate(strategy)


def test_local_sgd_is_priced_between_local_and_global_reduction():
    model = _model(0.3)
    plain = Strategy(dp=16, micro_batch_size=4)
    local = plain.model_copy(
        update={"compression": Compression(kind="local_sgd", period=8, local_group=8)}
    )
    exact, periodic = model.estimate(plain), model.estimate(local)
    assert periodic.step_time_s < exact.step_time_s
    assert model.dp_payload_bytes(local) == pytest.approx(model.dp_payload_bytes(plain) / 8)
    with pytest.raises(SpecError, match=r"local_group = 16 (must divide dp|with dp\(16\))"):
        model.estimate(
            plain.model_copy(
                update={"compression": Compression(kind="local_sgd", period=8, local_group=16)}
            )
        )


def test_plan_states_the_trade_off():
    handle = resolve_model("gpt3-1.3b", device="meta")
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=16, inter_node_GBps=0.3)
    plan = make_plan(handle, cluster, Training(global_batch_size=64), lossy=ALL)
    assert plan.strategy.compression.kind is CompressionKind.POWERSGD
    (tradeoff,) = plan.tradeoffs
    assert "fewer bytes" in tradeoff and "rank-4" in tradeoff and "GiB memory" in tradeoff
    exact = make_plan(handle, cluster, Training(global_batch_size=64))
    assert exact.tradeoffs == ()


def test_cluster_profiles_load_and_refuse_a_different_size():
    assert {"h100-2site-100g", "a100-25gbe", "h100-4site-10g"} <= set(list_clusters())
    two_sites = load_cluster("h100-2site-100g")
    assert two_sites.num_gpus == 512 and two_sites.extra_tiers[0].domain_size == 256
    assert resolve_cluster("h100-2site-100g") == two_sites
    with pytest.raises(SpecError, match="drop --gpus"):
        resolve_cluster("h100-2site-100g", num_gpus=64)
    with pytest.raises(SpecError, match="give --gpus"):
        resolve_cluster("h100-sxm-80gb")
    with pytest.raises(UnknownNameError, match="h100-2site-100g"):
        resolve_cluster("h100-2site")
    assert resolve_cluster("h100-sxm-80gb", num_gpus=16).num_gpus == 16


def test_a_cluster_profile_without_tiers_takes_any_whole_node_count():
    """A cluster profile whose links are per node (a cloud's fabric) sizes like a GPU
    profile; one whose sites share uplinks keeps the size its tiers describe."""
    p5 = resolve_cluster("aws-p5", num_gpus=256)
    assert (p5.num_gpus, p5.gpu, p5.inter_node_latency_us) == (256, "h100-sxm-80gb", 23)
    assert resolve_cluster("aws-p5") == load_cluster("aws-p5")
    with pytest.raises(SpecError, match=r"num_gpus \(12\) must be a multiple of gpus_per_node"):
        resolve_cluster("aws-p5", num_gpus=12)


def test_a_hardware_profile_file_is_a_gpu_profile(tmp_path):
    """What ``plan calibrate`` writes names the GPU (with --gpus), as a profile name does."""
    profile = tmp_path / "my-gpu.json"
    profile.write_text((profile_dir() / "h100-sxm-80gb.json").read_text())
    cluster = resolve_cluster(str(profile), num_gpus=4)
    assert (cluster.gpu, cluster.num_gpus) == (str(profile), 4)
    with pytest.raises(SpecError, match="is a GPU profile: give --gpus"):
        resolve_cluster(str(profile))


@pytest.mark.slow  # dozens of searches
def test_slow_tier_carries_only_the_outer_axes():
    """Tensor, context and pipeline traffic stay off the slowest link; what crosses the
    sites is data parallel (or pipeline) traffic."""
    cluster = Cluster(
        gpu="h100-sxm-80gb", num_gpus=64, inter_node_GBps=50,
        extra_tiers=(LinkTier(name="site", domain_size=32, uplink_GBps=1.25, latency_us=1000),),
    )  # fmt: skip
    handle = resolve_model("llama3-8b", device="meta")
    plan = make_plan(handle, cluster, Training(global_batch_size=128), lossy=ALL)
    profile = load_profile(cluster.gpu)
    stride = 1
    for axis in reversed(plan.mesh):  # innermost first
        link = link_for_axis(axis.size, stride, cluster, profile)
        if axis.name in (Axis.TP, Axis.CP):
            assert link.name == "intra_node", axis
        stride *= axis.size
    outer = plan.mesh[0]
    assert outer.name in (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD)


@pytest.mark.slow  # dozens of searches
def test_cli_allows_lossy_compression_only_when_asked(tmp_path, capsys):
    base = ["--model", "gpt3-1.3b", "--cluster", "a100-25gbe", "--global-batch", "256"]
    exact, lossy = tmp_path / "exact.json", tmp_path / "lossy.json"
    assert main([*base, "-o", str(exact)]) == 0
    assert main([*base, "--allow-lossy-compression", "powersgd:2", "-o", str(lossy)]) == 0
    printed = capsys.readouterr().out
    assert "trade-off" in printed
    assert "on 128 x a100-sxm-80gb in a100-25gbe" in " ".join(printed.split())  # its links
    assert Plan.from_json(exact.read_text()).strategy.compression.kind is CompressionKind.NONE
    chosen = Plan.from_json(lossy.read_text())
    assert chosen.strategy.compression == Compression(kind="powersgd", rank=2, warmup_steps=1000)
    assert chosen.tradeoffs and chosen.cluster.name == "a100-25gbe"
    assert main([*base, "--allow-lossy-compression", "topk"]) == 2
    assert "'topk' is unknown" in capsys.readouterr().err
    assert main(["profiles"]) == 0
    assert "h100-2site-100g" in capsys.readouterr().out


def test_int8_reduce_scatter_is_priced_on_fsdp_only():
    model = _model(1.0)
    fsdp = Strategy(dp=16, zero=3, micro_batch_size=4)
    int8 = fsdp.model_copy(update={"compression": Compression(kind="int8")})
    exact, quantized = model.estimate(fsdp), model.estimate(int8)
    assert (
        quantized.breakdown_s["comm_fsdp"] < 0.75 * exact.breakdown_s["comm_fsdp"]
    )  # gathers stay
    assert quantized.breakdown_s["compression"] > 0
    assert quantized.memory_gib["compression"] > 0
    ratio = model.dp_payload_bytes(int8) / model.dp_payload_bytes(fsdp)
    assert ratio == pytest.approx((1 + 4 / 256) / 4, rel=1e-6)
    with pytest.raises(SpecError, match=r"int8'? with zero = 0"):
        model.estimate(Strategy(dp=16, micro_batch_size=4, compression=Compression(kind="int8")))


def test_tied_weights_keep_ddp_hooks_off_tensor_parallel_shards():
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=16)
    mesh = {"dp": 8, "tp": 2, "pp": 1, "cp": 1, "zero": 0}
    untied = [decode(k).kind for k in ALL.keys(cluster, DType.BF16, **mesh)]
    tied = [decode(k).kind for k in ALL.keys(cluster, DType.BF16, **mesh, ddp_over_tp=False)]
    assert CompressionKind.POWERSGD in untied and tied == [CompressionKind.NONE]
    spec = get_preset("tiny-gpt").model_copy(update={"tied_embeddings": True})
    handle = ModelHandle(
        "tiny-gpt-tied", "tests", build(spec, device="meta"), lambda b, s: (), spec
    )
    strategy = Strategy(
        dp=8, tp=2, micro_batch_size=8, compression=Compression(kind="powersgd", rank=4)
    )
    plan = assemble_plan(handle, cluster, Training(global_batch_size=64, seq_len=16), strategy)
    with pytest.raises(SpecError, match="tied weights: DDP cannot run over tensor-parallel"):
        check_model_against_plan(plan, handle.module)


def test_a_cluster_files_profile_path_is_read_from_the_cluster_files_directory(
    tmp_path, monkeypatch
):
    """A cluster JSON naming its GPU by a profile file (``plan calibrate``'s) beside it
    works from any directory; a missing one is refused naming the cluster's field."""
    (tmp_path / "my-gpu.json").write_text((profile_dir() / "h100-sxm-80gb.json").read_text())
    (tmp_path / "cluster.json").write_text('{"gpu": "my-gpu.json", "num_gpus": 8}')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cluster = resolve_cluster("../cluster.json")
    assert Path(cluster.gpu) == Path("../my-gpu.json") and Path(cluster.gpu).is_file()
    (tmp_path / "bad.json").write_text('{"gpu": "gone.json", "num_gpus": 8}')
    with pytest.raises(SpecError, match=r"gpu = 'gone.json' names a hardware-profile file"):
        resolve_cluster("../bad.json")
