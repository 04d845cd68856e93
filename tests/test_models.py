"""The model zoo: presets build on meta, parameter counts, fingerprints, name errors."""

from __future__ import annotations

import copy
import json
import sys
import types

import pytest
import torch
from torch import nn

from planner.errors import SpecError, UnknownNameError
from planner.models import (
    PRESETS,
    SMALL_MODELS,
    build,
    fingerprint,
    handle_for_module,
    list_models,
    resolve_model,
)
from planner.spec import ModelSpec


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_on_meta_with_the_spec_parameter_count(name):
    spec = PRESETS[name]
    model = build(spec)
    assert next(model.parameters()).device == torch.device("meta")
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    assert list(model.layers) == [str(i) for i in range(spec.num_layers)]


# Qwen3's shape: heads wider than hidden / heads (4 x 16 query features on 48)
WIDE_HEADS = ModelSpec(
    name="wide-heads", family="llama", num_layers=2, hidden_size=48, num_heads=4,
    num_kv_heads=2, head_dim=16, vocab_size=256, seq_len=32,
)  # fmt: skip
QK_NORM = WIDE_HEADS.model_copy(update={"name": "qk-norm", "qk_norm": True})


@pytest.mark.parametrize(
    ("spec", "architecture"),
    [(WIDE_HEADS, "LlamaForCausalLM"), (QK_NORM, "Qwen3ForCausalLM")],
    ids=["wide-heads", "qk-norm"],
)
def test_wide_heads_and_qk_norms_match_hugging_face(spec, architecture):
    transformers = pytest.importorskip("transformers")
    from planner.models.hf_layout import hf_llama_config, zoo_name

    zoo = build(spec, device="cpu", seed=0).eval()
    attention = zoo.layers["0"].attention
    assert (attention.wq.weight.shape, attention.wk.weight.shape) == ((64, 48), (32, 48))
    assert attention.wo.weight.shape == (48, 64)
    assert sum(p.numel() for p in zoo.parameters()) == spec.num_params()
    fields = hf_llama_config(spec)
    assert fields["architectures"] == [architecture]
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert type(hf).__name__ == architecture
    for name, value in hf.state_dict().items():
        if name.endswith("_norm.weight"):  # not all ones, so the norms are compared
            value.uniform_(0.5, 1.5)
    zoo.load_state_dict({zoo_name(name): value for name, value in hf.state_dict().items()})
    tokens = torch.randint(0, spec.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(zoo(tokens), hf(tokens).logits)


def test_wide_head_attention_takes_its_heads_from_local_shapes():
    """Column shards of wq/wk/wv and row shards of wo (tensor parallelism) sum to the
    whole; the per-head q/k norms run on each shard's own heads."""
    attention = build(QK_NORM, device="cpu", seed=0).layers["0"].attention
    assert attention.q_norm is not None and attention.q_norm.weight.shape == (16,)
    x = torch.randn(2, 8, 48)
    with torch.no_grad():
        whole, parts = attention(x), torch.zeros(2, 8, 48)
        for rank in range(2):
            shard = copy.deepcopy(attention)
            for name in ("wq", "wk", "wv"):
                weight = getattr(attention, name).weight
                rows = weight.shape[0] // 2
                getattr(shard, name).weight = nn.Parameter(weight[rank * rows : (rank + 1) * rows])
            shard.wo.weight = nn.Parameter(attention.wo.weight[:, rank * 32 : (rank + 1) * 32])
            parts += shard(x)
    torch.testing.assert_close(parts, whole)


def test_fingerprints_are_stable_and_distinct():
    tiny = PRESETS["tiny-llama"]
    assert fingerprint(build(tiny)) == fingerprint(build(tiny, device="cpu", seed=1))
    prints = {fingerprint(build(PRESETS[name])) for name in ("tiny-gpt", "tiny-llama", "gpt2")}
    assert len(prints) == 3
    deeper = tiny.model_copy(update={"num_layers": tiny.num_layers + 1})
    assert fingerprint(build(deeper)) != fingerprint(build(tiny))


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_tiny_presets_run_forward_on_cpu(name):
    handle = resolve_model(name, device="cpu", seed=0)
    (tokens,) = handle.make_inputs(2, 16)
    logits = handle.module(tokens)
    assert logits.shape == (2, 16, PRESETS[name].vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", sorted(SMALL_MODELS))
def test_small_models_run_forward_on_cpu(name):
    handle = resolve_model(name, device="cpu", seed=0)
    out = handle.module(*handle.make_inputs(3, 1))
    assert out.shape[0] == 3
    assert torch.isfinite(out).all()


def test_aliases_resolve_and_are_listed():
    assert resolve_model("llama3.1-8b").spec == PRESETS["llama3-8b"]
    assert {"llama3.1-8b", "mlp", "gpt2"} <= set(list_models())


def test_unknown_preset_lists_close_names():
    with pytest.raises(UnknownNameError, match=r"Did you mean 'llama3-70b'"):
        resolve_model("llama3-70")


def test_module_function_path_resolves(monkeypatch):
    module = types.ModuleType("user_zoo_models")
    module.wide = lambda: (nn.Linear(4, 6), torch.randn(2, 4))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "user_zoo_models", module)
    handle = resolve_model("user_zoo_models:wide")
    assert handle.name == "user_zoo_models:wide"  # the path it was built from
    assert handle.device == torch.device("meta")
    assert handle.make_inputs(1, 1)[0].shape == (2, 4)


class _Parameterless(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor]:
        return (torch.randn(batch_size, 3),)


def test_a_module_without_parameters_gets_its_example_inputs():
    handle = handle_for_module(_Parameterless())
    assert handle.make_inputs(2, 1)[0].shape == (2, 3)


def test_module_path_that_does_not_import():
    with pytest.raises(SpecError, match="cannot import 'no_such_package_xyz'"):
        resolve_model("no_such_package_xyz:make")


def test_module_path_finds_the_users_project_in_the_current_directory(tmp_path, monkeypatch):
    """`plan --model mymodel:build` run in the user's project, as `python -m` would."""
    (tmp_path / "my_project_model_xyz.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    handle = resolve_model("my_project_model_xyz:build")
    assert isinstance(handle.module, torch.nn.Linear)


def test_module_path_without_the_function(monkeypatch):
    monkeypatch.setitem(sys.modules, "user_zoo_empty", types.ModuleType("user_zoo_empty"))
    with pytest.raises(SpecError, match="has no callable 'missing'"):
        resolve_model("user_zoo_empty:missing")


def test_spec_file_resolves(tmp_path):
    spec = PRESETS["tiny-llama"].model_copy(update={"name": "mine"})
    path = tmp_path / "mine.json"
    path.write_text(spec.to_json())
    handle = resolve_model(str(path))
    assert handle.spec == spec
    assert sum(p.numel() for p in handle.module.parameters()) == spec.num_params()


def test_spec_file_with_bad_fields_gives_one_line_per_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"family": "llama", "num_layers": 0, "hidden_size": 64,
                                "num_heads": 4, "vocab_size": -3, "seq_len": 32}))  # fmt: skip
    with pytest.raises(SpecError) as info:
        resolve_model(str(path))
    lines = str(info.value).splitlines()
    assert lines[0].startswith("invalid ModelSpec in")
    assert any(line.strip().startswith("num_layers = 0:") for line in lines)
    assert any(line.strip().startswith("vocab_size = -3:") for line in lines)
    assert len(lines) == 3


def test_spec_validation_names_both_fields():
    with pytest.raises(
        ValueError, match=r"hidden_size \(65\) must be divisible by num_heads \(4\)"
    ):
        ModelSpec(family="gpt", num_layers=1, hidden_size=65, num_heads=4, vocab_size=8, seq_len=4)


def test_a_python_file_given_as_a_model_is_told_to_name_its_function():
    with pytest.raises(SpecError, match=r"'\.\./nanogpt\.py' is a Python file: .*nanogpt:build"):
        resolve_model("../nanogpt.py")
