"""Context parallel and tied embeddings on gloo ranks match one process.

Reuses the harness of :mod:`tests.test_runtime_numerics`: one process group per world
size runs every case; each case trains a few optimizer steps and its global mean loss
must stay within ``EXACT`` of the single-process reference on every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from planner.assemble import assemble_plan
from planner.models import resolve_model
from planner.spec import Cluster, Strategy, Training
from strategies.mesh import build_mesh, replicate_mesh, shard_mesh
from tests.test_runtime_numerics import Case, _compare, _per_rank, run_cases

TIED = "tiny-gpt-tied"

WORLD2 = [
    Case("tiny-llama cp2", "tiny-llama", _per_rank(1, cp=2)),
    Case("tiny-gpt cp2", "tiny-gpt", _per_rank(1, cp=2)),
    Case("tiny-llama cp2 fsdp over cp", "tiny-llama", _per_rank(1, cp=2, zero=3)),
    Case("tiny-llama cp2 recompute full", "tiny-llama", _per_rank(1, cp=2, recompute="full")),
    Case("tiny-gpt-tied tp", TIED, _per_rank(1, tp=2)),
    Case("tiny-gpt-tied tp (loss parallel)", TIED, _per_rank(1, tp=2)),
    Case("tiny-gpt-tied ddp", TIED, _per_rank(2)),
    Case("tiny-gpt-tied fsdp", TIED, _per_rank(2, zero=3)),
]
WORLD4 = [
    Case("tiny-llama cp4", "tiny-llama", _per_rank(1, cp=4)),
    Case("tiny-gpt cp4", "tiny-gpt", _per_rank(1, cp=4)),
    Case("tiny-llama cp2 x tp2", "tiny-llama", _per_rank(1, cp=2, tp=2)),
    Case("tiny-gpt cp2 x tp2+sp", "tiny-gpt", _per_rank(1, cp=2, tp=2, sequence_parallel=True)),
    Case("tiny-llama cp2 x dp2 (fsdp)", "tiny-llama", _per_rank(2, cp=2, zero=3)),
    Case("tiny-gpt cp2 x dp2 (ddp)", "tiny-gpt", _per_rank(2, cp=2)),
    Case(
        "tiny-llama cp2 x dp2 (hsdp, shard over cp)",
        "tiny-llama",
        _per_rank(2, cp=2, zero=3, dp_shard=1),
    ),
    Case(
        "tiny-gpt cp2 x dp2 fp16 hook",
        "tiny-gpt",
        _per_rank(2, cp=2, compression={"kind": "fp16"}),
        bound=1e-3,
    ),
    # cp ranks replicate the weights; under a pipeline (or over tied TP shards) FSDP2 does
    Case(
        "tiny-llama cp2 x pp2", "tiny-llama", _per_rank(1, cp=2, pp=2, zero=2, num_microbatches=2)
    ),
    Case(
        "tiny-llama cp2 x pp2 zero-bubble",
        "tiny-llama",
        _per_rank(1, cp=2, pp=2, zero=2, num_microbatches=2, schedule="zero-bubble"),
    ),
    Case(
        "tiny-gpt cp2 x pp2 interleaved",
        "tiny-gpt",
        _per_rank(
            1,
            cp=2,
            pp=2,
            zero=2,
            num_microbatches=4,
            schedule="interleaved-1f1b",
            virtual_stages=2,
        ),
    ),
    Case("tiny-gpt-tied tp2 x dp2 (fsdp)", TIED, _per_rank(2, tp=2, zero=3)),
    Case("tiny-gpt-tied cp2 x tp2", TIED, _per_rank(1, cp=2, tp=2, zero=2)),
]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "cases"), [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"]
)
def test_context_parallel_and_tied_match_single_process(
    world_size: int, cases: list[Case], tmp_path: Path
) -> None:
    failures = _compare(cases, run_cases(world_size, cases, tmp_path))
    assert not failures, "\n".join(failures)


@pytest.fixture
def fake_world() -> Iterator[None]:
    """A fake 8-rank process group (no communication): meshes can be built in one process."""
    dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("strategy", "shard", "replicate"),
    [
        (
            {"dp": 4, "dp_shard": 2, "zero": 3, "cp": 2},
            {"dp_replicate": 2, "dp_shard_cp": 4},
            {"dp_replicate_cp": 4},
        ),
        ({"dp": 2, "cp": 2, "tp": 2}, {"dp_replicate": 2, "cp": 2}, {"dp_replicate_cp": 4}),
        (
            {"dp": 2, "dp_shard": 1, "zero": 3, "cp": 2, "tp": 2},
            {"dp_replicate": 2, "cp": 2},
            {"dp_replicate_cp": 4},
        ),
        ({"cp": 4, "tp": 2, "zero": 3}, {"cp": 4}, {"cp": 4}),
    ],
)
def test_gradient_meshes_join_cp_with_data_parallel(
    fake_world: None, strategy: dict[str, Any], shard: dict[str, int], replicate: dict[str, int]
) -> None:
    parsed = Strategy.model_validate(strategy)
    cluster = Cluster(gpu="cpu", num_gpus=8, gpus_per_node=8)
    training = Training(global_batch_size=parsed.dp)
    plan = assemble_plan(resolve_model("tiny-llama"), cluster, training, parsed)
    mesh = build_mesh(plan)
    assert mesh is not None
    assert _axes(shard_mesh(mesh)) == shard
    assert _axes(replicate_mesh(mesh)) == replicate


def _axes(mesh: DeviceMesh) -> dict[str, int]:
    return dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))
