"""Mixture-of-experts weights from Hugging Face safetensors, sharded under any plan.

transformers keeps experts grouped in memory (``gate_up_proj [E, 2F, H]``, ``down_proj
[E, H, F]``) but writes them one tensor per expert, as Hub checkpoints hold them:
Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, Qwen3-MoE's
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``. Loading composes each rank's
part of the grouped weights from those, reading only its experts' slices; the zoo MoE
exports under Mixtral's names and loads back.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from planner.errors import SpecError
from planner.models import build, get_preset
from planner.models.hf_layout import (
    check_hf_layout,
    hf_llama_config,
    hf_name,
    per_expert_layouts,
    zoo_name,
)
from planner.spec import Family, ModelSpec
from strategies.apply import parallelize
from strategies.runner import Trainer
from strategies.state import _fill_experts, export_hf
from tests.ranks import Task, run_on_ranks
from tests.test_checkpoint import check_loads
from tests.test_deferred_init import _one_process_plan
from tests.test_runtime_expert_parallel import Case, _hf_model, _per_rank, run_steps
from tests.test_runtime_numerics import LR, SEQ, VOCAB, parameter_digests

transformers = pytest.importorskip("transformers")

LOSS_BOUND = 1e-6  # fp32 EP against one process (README: within 9.5e-7)
HF_MODELS = ("hf-mixtral", "hf-qwen3-moe")
MIXTRAL_ZOO = ModelSpec(
    name="tiny-mixtral", family=Family.LLAMA, num_layers=2, hidden_size=64, num_heads=4,
    num_kv_heads=2, vocab_size=VOCAB, seq_len=32, num_experts=8, top_k=2,
    moe_ffn_hidden_size=32,
)  # fmt: skip


def _names(directory: Path) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            names = handle.keys()
            shapes |= {k: list(handle.get_slice(k).get_shape()) for k in names}
    return shapes


def hf_moe_dir(directory: Path, model: str) -> Path:
    """``model`` (a tiny transformers MoE, seed 5) as safetensors in several files."""
    torch.manual_seed(5)
    module: Any = _hf_model(model)  # a transformers PreTrainedModel
    module.save_pretrained(directory, max_shard_size="60KB")
    return directory


def zoo_moe_dir(directory: Path, spec: ModelSpec) -> Path:
    """The zoo model of ``spec`` (seed 6) saved, then exported as safetensors."""
    model = build(spec, device="meta")
    parallel = parallelize(model, _one_process_plan(model), seed=6)
    parallel.save(directory / "ckpt", step=0)
    config = hf_llama_config(spec) if not spec.num_shared_experts else None
    return export_hf(directory / "ckpt", directory / "hf", rename=hf_name, config=config,
                     max_shard_bytes=100_000)  # fmt: skip


def meta_moe(model: str) -> torch.nn.Module:
    if model == "tiny-moe":
        return build(get_preset("tiny-moe"), device="meta")
    return _hf_model(model, "meta")


# ---- names and one process


def test_transformers_writes_experts_one_tensor_per_expert(tmp_path: Path) -> None:
    mixtral = _names(hf_moe_dir(tmp_path / "mixtral", "hf-mixtral"))
    qwen = _names(hf_moe_dir(tmp_path / "qwen", "hf-qwen3-moe"))
    assert mixtral["model.layers.1.block_sparse_moe.experts.7.w1.weight"] == [32, 64]
    assert mixtral["model.layers.1.block_sparse_moe.experts.7.w2.weight"] == [64, 32]
    assert "model.layers.1.block_sparse_moe.gate.weight" in mixtral
    assert qwen["model.layers.1.mlp.experts.7.up_proj.weight"] == [32, 64]
    assert not [n for n in [*mixtral, *qwen] if n.endswith(("gate_up_proj", "down_proj"))]


@pytest.mark.parametrize("model", HF_MODELS)
def test_per_expert_safetensors_load_into_a_meta_transformers_moe(
    tmp_path: Path, model: str
) -> None:
    directory = hf_moe_dir(tmp_path, model)
    torch.manual_seed(5)
    original = _hf_model(model).eval()
    meta = meta_moe(model)
    loaded = parallelize(meta, _one_process_plan(meta), weights=directory).eval()
    params = dict(loaded.named_parameters())
    for name, param in original.named_parameters():
        assert torch.equal(params[name], param), name
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, original(tokens).logits)


def test_a_grouped_checkpoint_loads_as_it_is(tmp_path: Path) -> None:
    torch.manual_seed(5)
    original = _hf_model("hf-mixtral")
    tmp_path.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in original.state_dict().items()},
              tmp_path / "model.safetensors")  # fmt: skip
    meta = meta_moe("hf-mixtral")
    loaded = parallelize(meta, _one_process_plan(meta), weights=tmp_path)
    params = dict(loaded.named_parameters())
    for name, param in original.named_parameters():
        assert torch.equal(params[name], param), name


def test_the_zoo_moe_exports_mixtral_names_and_loads_back(tmp_path: Path) -> None:
    spec = get_preset("tiny-moe")
    out = zoo_moe_dir(tmp_path, spec)
    names = _names(out)
    assert names["model.layers.1.block_sparse_moe.experts.7.w3.weight"] == [32, 64]
    assert "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense first block
    assert not [n for n in names if n.endswith(("gate_up_proj", "down_proj"))]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(names)
    assert len(set(index["weight_map"].values())) > 1
    model = build(spec, device="meta")
    loaded = parallelize(model, _one_process_plan(model), weights=out)
    saved = build(spec, device="meta")
    expected = parallelize(saved, _one_process_plan(saved), weights=tmp_path / "ckpt")
    assert parameter_digests(loaded) == parameter_digests(expected)


def test_a_zoo_moe_with_shared_experts_loads_beside_a_config_of_its_maths(
    tmp_path: Path,
) -> None:
    """A config.json beside the safetensors is read for the maths beyond shapes; a zoo
    MoE no Hugging Face config class describes (shared experts, a dense first block)
    is compared on those alone."""
    spec = get_preset("tiny-moe")
    out = zoo_moe_dir(tmp_path, spec)
    config = {"rope_theta": spec.rope_theta, "rms_norm_eps": spec.norm_eps, "hidden_act": "silu"}
    (out / "config.json").write_text(json.dumps(config))
    model = build(spec, device="meta")
    parallelize(model, _one_process_plan(model), weights=out)
    (out / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-6}))
    with pytest.raises(SpecError, match=r"rms_norm_eps = 1e-06"):
        parallelize(build(spec, device="meta"), _one_process_plan(model), weights=out)


def test_a_mixtral_shaped_zoo_moe_is_transformers_mixtral(tmp_path: Path) -> None:
    out = zoo_moe_dir(tmp_path, MIXTRAL_ZOO)
    hf = transformers.MixtralForCausalLM.from_pretrained(out).eval()
    meta = build(MIXTRAL_ZOO, device="meta")
    zoo = parallelize(meta, _one_process_plan(meta), weights=out).eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(zoo(tokens), hf(tokens).logits, rtol=0, atol=1e-5)


def test_zoo_moe_names_map_both_ways_and_mixtral_config_refuses_what_it_lacks() -> None:
    for fqn in ("layers.3.feed_forward.router.weight", "layers.3.feed_forward.experts.down_proj",
                "layers.1.feed_forward.shared_experts.w2.weight"):  # fmt: skip
        assert zoo_name(hf_name(fqn)) == fqn
    check_hf_layout(get_preset("tiny-moe"))
    with pytest.raises(SpecError, match="num_shared_experts=1"):
        hf_llama_config(get_preset("tiny-moe"))
    assert hf_llama_config(MIXTRAL_ZOO)["num_local_experts"] == 8


def test_per_expert_names_of_mixtral_and_qwen_spellings() -> None:
    mixtral = per_expert_layouts("model.layers.0.mlp.experts.gate_up_proj")
    assert {(lay.prefix, lay.parts) for lay in mixtral} >= {
        ("model.layers.0.block_sparse_moe.experts", ("w1.weight", "w3.weight")),
        ("model.layers.0.mlp.experts", ("gate_proj.weight", "up_proj.weight")),
    }
    assert per_expert_layouts("model.layers.0.mlp.gate.weight") == []


def test_a_shard_reads_only_its_experts_and_rows() -> None:
    """The part ``[2:4, 3:7, 1:5]`` of a grouped ``[4, 8, 6]`` gate_up: experts 2 and 3,
    gate rows 3 and up rows 0-2, columns 1-4, each read as such a slice."""
    (layout,) = per_expert_layouts("m.block_sparse_moe.experts.gate_up_proj")[:1]
    whole = torch.randn(4, 8, 6)
    stored = {layout.name(e, p): whole[e, 4 * k : 4 * (k + 1)]
              for e in range(4) for k, p in enumerate(layout.parts)}  # fmt: skip
    reads: list[tuple[str, slice, slice]] = []

    def read(name: str, rows: slice, columns: slice) -> torch.Tensor:
        reads.append((name, rows, columns))
        return stored[name][rows, columns]

    local = torch.zeros(2, 4, 4)
    _fill_experts(local, (slice(2, 4), slice(3, 7), slice(1, 5)), 8, layout, read)
    assert torch.equal(local, whole[2:4, 3:7, 1:5])
    assert {name for name, _, _ in reads} == {
        layout.name(e, p) for e in (2, 3) for p in layout.parts
    }
    assert all(r.stop - r.start <= 3 for _, r, _ in reads)


def test_a_missing_or_misshapen_expert_is_refused(tmp_path: Path) -> None:
    directory = hf_moe_dir(tmp_path / "hf", "hf-mixtral")
    tensors: dict[str, torch.Tensor] = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            names = handle.keys()
            tensors |= {k: handle.get_tensor(k) for k in names}
    name = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    for case, value in (("missing", None), ("misshapen", tensors[name][:16])):
        broken = tmp_path / case
        broken.mkdir()
        kept = {k: v for k, v in tensors.items() if k != name}
        save_file(kept if value is None else kept | {name: value}, broken / "model.safetensors")
        meta = meta_moe("hf-mixtral")
        match = f"no '{name}'" if value is None else f"'{name}' has shape"
        with pytest.raises(SpecError, match=match):
            parallelize(meta, _one_process_plan(meta), weights=broken)
    # more experts than the model's (from a tester: the extra ones were dropped silently)
    extra = tmp_path / "extra"
    extra.mkdir()
    more = {name.replace("experts.5.", "experts.9."): tensors[name].clone()} | tensors
    save_file(more, extra / "model.safetensors")
    meta = meta_moe("hf-mixtral")
    with pytest.raises(
        SpecError,
        match=r"holds 1 tensors the model has none of \(first: "
        r"'model\.layers\.1\.block_sparse_moe\.experts\.9\.",
    ):
        parallelize(meta, _one_process_plan(meta), weights=extra)


# ---- sharded on gloo ranks


def load_and_train(case: Case, directory: str, world_size: int, rank: int) -> dict[str, Any]:
    """Gathered weights of ``case``'s model built on meta and loaded from ``directory``,
    and 3 SGD steps' losses."""
    parallel = parallelize(meta_moe(case.model), case.plan(world_size), weights=directory)
    weights = parameter_digests(parallel)
    trainer = Trainer(parallel, lr=LR)
    return {"weights": weights, "losses": run_steps(parallel, trainer, rank, range(3))}


def _loads(model: str) -> list[Case]:
    return [
        Case(f"{model} ep2 x ddp", model, _per_rank(4, ep=2)),
        Case(f"{model} ep4", model, _per_rank(4, ep=4)),
        Case(f"{model} ep2 x fsdp", model, _per_rank(4, ep=2, zero=3)),
        Case(f"{model} tp2 x ep2", model, _per_rank(2, tp=2, ep=2)),
        Case(f"{model} fsdp4 (ep 1)", model, _per_rank(4, zero=3)),
    ]


LOADS = [case for model in (*HF_MODELS, "tiny-moe") for case in _loads(model)] + [
    # each pipeline stage reads only its own layers' experts
    Case(
        "hf-mixtral pp2 x ep2", "hf-mixtral", _per_rank(2, pp=2, ep=2, zero=2, num_microbatches=2)
    ),
]


@pytest.mark.distributed
@pytest.mark.slow
def test_moe_safetensors_load_sharded_and_train_as_one_process(tmp_path: Path) -> None:
    """Per-expert safetensors (transformers' Mixtral and Qwen3-MoE, the zoo MoE's export)
    into models built on meta under EP plans (and FSDP at ep 1) on 4 ranks: the gathered weights equal one
    process's that loaded the same files, the losses within ``LOSS_BOUND``."""
    directories = {model: str(hf_moe_dir(tmp_path / model, model)) for model in HF_MODELS}
    directories["tiny-moe"] = str(zoo_moe_dir(tmp_path / "zoo", get_preset("tiny-moe")))
    expected = {
        model: load_and_train(Case("one", model, {"micro_batch_size": 8}), directory, 1, 0)
        for model, directory in directories.items()
    }
    tasks: dict[str, Task] = {
        case.name: functools.partial(load_and_train, case.planned(4), directories[case.model], 4)
        for case in LOADS
    }
    check_loads(LOADS, run_on_ranks(4, tasks, tmp_path), expected, LOSS_BOUND)
