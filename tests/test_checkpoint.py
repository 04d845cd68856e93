"""Checkpoints: save and resume under another plan, weights from Hugging Face safetensors
or a checkpoint into each rank's shards, export to safetensors, and atomic saves.

Resumed runs are compared with one process training the same steps without a break; a
model loaded on several ranks with one process that loaded the same weights.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.errors import SpecError
from planner.models import build, get_preset
from planner.models.hf_layout import hf_llama_config, hf_name, zoo_name
from planner.spec import ModelSpec
from strategies.apply import parallelize
from strategies.parallel_model import ParallelModel, local_slice
from strategies.runner import Trainer, synthetic_batch
from strategies.state import LATEST, export_hf, local_part
from tests.ranks import run_on_ranks
from tests.test_deferred_init import _one_process_plan, meta_model
from tests.test_runtime_numerics import (
    BATCH,
    CLIP,
    LR,
    SEQ,
    VOCAB,
    Case,
    _per_rank,
    build_handle,
    parameter_digests,
)

transformers = pytest.importorskip("transformers")

SAVED_AT = 3  # steps before the checkpoint
TOTAL = 6  # steps in all
RESUME_BOUND = 1e-6  # a resume under the plan that saved: the same run
RESHARD_BOUND = 1e-5  # under another plan: as every strategy against one process
POWERSGD_RESUME_BOUND = 0.05  # its error feedback restarts at a resume (measured 0.02)


def run_steps(parallel: ParallelModel, trainer: Trainer, rank: int, steps: range) -> list[float]:
    plan = parallel.plan
    return [
        trainer.step(*local_slice(plan, rank, *synthetic_batch(VOCAB, BATCH, SEQ, seed=0, step=s)))
        for s in steps
    ]


def one_process(case: Case) -> Case:
    return Case(f"{case.model} one process", case.model, {"micro_batch_size": BATCH})


@functools.cache
def uninterrupted(model: str) -> list[float]:
    """Losses of ``TOTAL`` steps in one process, from seed 1."""
    plan = one_process(Case("", model, {})).plan(1)
    parallel = parallelize(meta_model(model), plan, seed=1)
    return run_steps(parallel, Trainer(parallel, lr=LR, max_grad_norm=CLIP), 0, range(TOTAL))


def save_then_resume(
    before: Case, after: Case, directory: Path, world_size: int, rank: int
) -> list[float]:
    """``SAVED_AT`` steps under ``before`` from seed 1, saved; then a model from another
    seed under ``after`` loads it and trains to ``TOTAL``: all the losses."""
    first = parallelize(meta_model(before.model), before.plan(world_size), seed=1)
    trainer = Trainer(first, lr=LR, max_grad_norm=CLIP)
    losses = run_steps(first, trainer, rank, range(SAVED_AT))
    first.save(directory, trainer.optimizer, step=SAVED_AT)
    second = parallelize(meta_model(after.model), after.plan(world_size), seed=2)
    trainer = Trainer(second, lr=LR, max_grad_norm=CLIP)
    step = second.load(directory, trainer.optimizer)
    assert step == SAVED_AT, step
    return losses + run_steps(second, trainer, rank, range(step, TOTAL))


# ---- one process


def test_resume_in_one_process_continues_exactly(tmp_path: Path) -> None:
    case = one_process(Case("", "tiny-llama", {}))
    losses = save_then_resume(case, case, tmp_path, 1, 0)
    assert losses == uninterrupted("tiny-llama")
    assert (tmp_path / LATEST).read_text().strip() == f"step-{SAVED_AT:08d}"


def test_a_later_save_becomes_latest_and_an_earlier_step_still_loads(tmp_path: Path) -> None:
    plan = one_process(Case("", "tiny-lm", {})).plan(1)
    parallel = parallelize(meta_model("tiny-lm"), plan, seed=1)
    trainer = Trainer(parallel, lr=LR)
    saved = {}
    for step in range(3):
        parallel.save(tmp_path, trainer.optimizer, step=step)
        saved[step] = parameter_digests(parallel)
        run_steps(parallel, trainer, 0, range(step, step + 1))
    fresh = parallelize(meta_model("tiny-lm"), plan, seed=5)
    assert fresh.load(tmp_path) == 2
    assert parameter_digests(fresh) == saved[2]
    assert fresh.load(tmp_path, step=0) == 0
    assert parameter_digests(fresh) == saved[0]
    with pytest.raises(SpecError, match=r"step-00000009.*complete ones.*step-00000000"):
        fresh.load(tmp_path, step=9)


def _warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5)


def test_a_learning_rate_schedule_resumes_where_it_was_saved(tmp_path: Path) -> None:
    """The scheduler's state goes in the checkpoint: a resume continues its warm-up (a
    new scheduler alone would start it over), and a checkpoint saved without one, or with
    another scheduler, is refused with what to do."""
    plan = one_process(Case("", "tiny-lm", {})).plan(1)
    parallel = parallelize(meta_model("tiny-lm"), plan, seed=1)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=LR)
    scheduler = _warmup(optimizer)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    parallel.save(tmp_path, optimizer, step=3, scheduler=scheduler)
    fresh = parallelize(meta_model("tiny-lm"), plan, seed=5)
    resumed_optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR)
    resumed = _warmup(resumed_optimizer)
    assert fresh.load(tmp_path, resumed_optimizer, scheduler=resumed) == 3
    assert resumed.state_dict() == scheduler.state_dict()
    for _ in range(2):
        for each in (optimizer, resumed_optimizer):
            each.step()
        scheduler.step()
        resumed.step()
        assert resumed.get_last_lr() == scheduler.get_last_lr()
        assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    parallel.save(tmp_path / "plain", optimizer, step=3)
    with pytest.raises(SpecError, match="holds no learning-rate scheduler: it was saved without"):
        fresh.load(tmp_path / "plain", resumed_optimizer, scheduler=resumed)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(resumed_optimizer, T_max=10)
    with pytest.raises(SpecError, match=r"holds another scheduler's state .*CosineAnnealingLR"):
        fresh.load(tmp_path, resumed_optimizer, scheduler=cosine)


def test_loading_needs_a_checkpoint_of_the_same_model(tmp_path: Path) -> None:
    plan = one_process(Case("", "tiny-llama", {})).plan(1)
    with pytest.raises(SpecError, match="has no 'latest' file"):
        parallelize(meta_model("tiny-llama"), plan).load(tmp_path)
    parallelize(meta_model("tiny-lm"), one_process(Case("", "tiny-lm", {})).plan(1)).save(
        tmp_path, step=1
    )
    with pytest.raises(SpecError, match="saved from another model"):
        parallelize(meta_model("tiny-llama"), plan).load(tmp_path)


def test_an_optimizer_of_another_kind_is_refused(tmp_path: Path) -> None:
    case = one_process(Case("", "tiny-lm", {}))
    parallel = parallelize(meta_model("tiny-lm"), case.plan(1), seed=1)
    adam = torch.optim.AdamW(parallel.parameters(), lr=LR)
    run_steps(parallel, Trainer(parallel, lr=LR), 0, range(1))
    adam.step()
    parallel.save(tmp_path, adam, step=1)
    sgd = torch.optim.SGD(parallel.parameters(), lr=LR, momentum=0.9)
    with pytest.raises(SpecError, match="saved with another optimizer"):
        parallel.load(tmp_path, sgd)


def hf_llama_dir(
    directory: Path, spec: ModelSpec, *, seed: int = 3, max_shard_size: str = "100KB"
) -> Path:
    """A random ``LlamaForCausalLM`` equal in shape to the zoo's ``spec``, saved as
    safetensors in several files (with an index)."""
    config = transformers.LlamaConfig(**hf_llama_config(spec))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def tied_llama() -> ModelSpec:
    return get_preset("tiny-llama").model_copy(update={"tied_embeddings": True})


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hugging_face_llama_weights_load_into_the_zoo_llama(tmp_path: Path, tied: bool) -> None:
    spec = tied_llama() if tied else get_preset("tiny-llama")
    directory = hf_llama_dir(tmp_path, spec)
    assert len(list(directory.glob("*.safetensors"))) > 1
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    model = build(spec, device="meta")
    zoo = parallelize(model, _one_process_plan(model), weights=directory).eval()
    tokens = torch.randint(0, spec.vocab_size, (2, SEQ))
    with torch.no_grad():
        assert torch.equal(zoo(tokens), hf(tokens).logits)


def test_weights_whose_config_computes_otherwise_are_refused_naming_the_setting(
    tmp_path: Path,
) -> None:
    """Llama 3.1's config scales the rotary frequencies (``rope_type`` llama3), which the
    zoo Llama does not: its weights fit the zoo model by name and shape, and would train
    another model. The load is refused, naming the setting and the way to train it."""
    spec = get_preset("tiny-llama")
    llama31 = {"rope_type": "llama3", "rope_theta": spec.rope_theta, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
    config = transformers.LlamaConfig(**hf_llama_config(spec) | {"rope_parameters": llama31})
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    scaled = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    plain = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, config=transformers.LlamaConfig(**hf_llama_config(spec))
    ).eval()
    tokens = torch.randint(0, spec.vocab_size, (2, SEQ))
    with torch.no_grad():  # the same weights, another model
        assert not torch.allclose(scaled(tokens).logits, plain(tokens).logits)
    model = build(spec, device="meta")
    with pytest.raises(
        SpecError, match=r"rope_type = 'llama3', where the zoo model .* 'default'.*--hf-config"
    ):
        parallelize(model, _one_process_plan(model), weights=tmp_path)


def test_a_meta_hugging_face_model_loads_its_safetensors(tmp_path: Path) -> None:
    directory = hf_llama_dir(tmp_path, get_preset("tiny-llama"))
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf.config)
    loaded = parallelize(model, _one_process_plan(model), weights=directory).eval()
    tokens = torch.randint(0, hf.config.vocab_size, (2, SEQ))
    with torch.no_grad():  # rotary inv_freq is no checkpoint tensor: initialised as HF does
        assert torch.equal(loaded(tokens).logits, hf(tokens).logits)


def test_weights_that_do_not_fit_the_model_are_refused(tmp_path: Path) -> None:
    plan = one_process(Case("", "tiny-llama", {})).plan(1)
    with pytest.raises(SpecError, match="no such directory"):
        parallelize(meta_model("tiny-llama"), plan, weights=tmp_path / "absent")
    wider = get_preset("tiny-llama").model_copy(update={"vocab_size": VOCAB * 2})
    directory = hf_llama_dir(tmp_path / "wide", wider)
    with pytest.raises(SpecError, match=r"'model\.embed_tokens\.weight' has shape"):
        parallelize(meta_model("tiny-llama"), plan, weights=directory)
    gpt = build(get_preset("tiny-gpt"), device="meta")
    gpt_plan = one_process(Case("", "tiny-gpt", {})).plan(1)
    with pytest.raises(SpecError, match="only zoo llama models load from or export to"):
        parallelize(gpt, gpt_plan, weights=directory)


def test_weights_of_another_model_or_broken_files_are_refused_by_name(tmp_path: Path) -> None:
    """From a tester: a deeper model's checkpoint loaded in part, silently; an untied one
    into a tied model dropped its head; broken files surfaced as other errors."""
    plan = one_process(Case("", "tiny-llama", {})).plan(1)
    deeper = get_preset("tiny-llama").model_copy(update={"num_layers": 6})
    directory = hf_llama_dir(tmp_path / "deeper", deeper, max_shard_size="10GB")
    with pytest.raises(
        SpecError,
        match=r"holds 18 tensors the model has none of \(first: "
        r"'model\.layers\.4\.input_layernorm\.weight'\)",
    ):
        parallelize(meta_model("tiny-llama"), plan, weights=directory)
    untied = hf_llama_dir(tmp_path / "untied", get_preset("tiny-llama"), max_shard_size="10GB")
    tied = build(tied_llama(), device="meta")
    with pytest.raises(
        SpecError,
        match=r"holds 'lm_head\.weight' apart from "
        r"'model\.embed_tokens\.weight', with other values",
    ):
        parallelize(tied, _one_process_plan(tied), weights=untied)
    with pytest.raises(SpecError, match=r"is a file: give the directory that holds it"):
        parallelize(meta_model("tiny-llama"), plan, weights=untied / "model.safetensors")
    sharded = hf_llama_dir(tmp_path / "sharded", get_preset("tiny-llama"))
    gone = sorted(sharded.glob("*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(
        SpecError,
        match=rf"{gone.name} \(1 of \d+ files "
        r"model\.safetensors\.index\.json names\) is not there",
    ):
        parallelize(meta_model("tiny-llama"), plan, weights=sharded)
    (untied / "model.safetensors").write_bytes((untied / "model.safetensors").read_bytes()[:100])
    with pytest.raises(SpecError, match=r"model\.safetensors' cannot be read .*truncated"):
        parallelize(meta_model("tiny-llama"), plan, weights=untied)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({}, pickled / "pytorch_model.bin")
    with pytest.raises(SpecError, match=r"holds pytorch_model\.bin and no \*\.safetensors"):
        parallelize(meta_model("tiny-llama"), plan, weights=pickled)


def test_a_tied_module_loads_whichever_name_safetensors_kept(tmp_path: Path) -> None:
    """safetensors' save_model keeps one name of a tied pair, here the nanoGPT-style
    module's head rather than its embedding: the embedding reads it (it was refused as
    missing)."""
    from safetensors.torch import save_model

    from planner import parameters_on_meta
    from tests.user_models import gpt_tied

    torch.manual_seed(7)
    saved = gpt_tied()
    save_model(saved, str(tmp_path / "model.safetensors"))
    with parameters_on_meta():
        meta = gpt_tied()
    loaded = parallelize(meta, _one_process_plan(meta), weights=tmp_path).eval()
    tokens = torch.randint(0, 256, (2, SEQ))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), saved.eval()(tokens))


def test_a_checkpoint_of_a_deeper_model_is_refused(tmp_path: Path) -> None:
    """parallel.save's checkpoint of a deeper model into a shallower one, likewise."""
    deeper = get_preset("tiny-llama").model_copy(update={"num_layers": 6})
    model = build(deeper, device="meta")
    parallel = parallelize(model, _one_process_plan(model))
    parallel.save(tmp_path, torch.optim.SGD(parallel.parameters(), lr=LR), step=1)
    plan = one_process(Case("", "tiny-llama", {})).plan(1)
    with pytest.raises(
        SpecError,
        match=r"checkpoint .* holds \d+ tensors the model has none "
        r"of \(first: 'model\.layers\.4\.",
    ):
        parallelize(meta_model("tiny-llama"), plan, weights=tmp_path)


def _load_where(directories: list[str], rank: int) -> str:
    """What this rank's parallelize says given ``directories[rank]`` as weights."""
    try:
        parallelize(meta_model("tiny-llama"), Case("", "tiny-llama", {"dp": 2, "micro_batch_size": BATCH // 2}).plan(2),
                    weights=directories[rank])  # fmt: skip
    except SpecError as error:
        return str(error)
    return "loaded"


@pytest.mark.distributed
def test_weights_one_rank_cannot_read_are_refused_on_every_rank_with_its_reason(
    tmp_path: Path,
) -> None:
    """From a tester: the other ranks reported only a closed connection."""
    good = hf_llama_dir(tmp_path / "good", get_preset("tiny-llama"))
    bad = hf_llama_dir(tmp_path / "bad", get_preset("tiny-llama"))
    gone = sorted(bad.glob("*.safetensors"))[0]
    gone.unlink()
    said = run_on_ranks(2, {"load": functools.partial(_load_where, [str(good), str(bad)])},
                        tmp_path)["load"]  # fmt: skip
    assert said[0] == said[1], said
    assert said[0].startswith(f"rank 1: Hugging Face safetensors {str(bad)!r}: {gone.name}")


def test_zoo_and_hugging_face_names_map_both_ways() -> None:
    for fqn in ("tok_embeddings.weight", "layers.11.feed_forward.w3.weight", "output.weight"):
        assert zoo_name(hf_name(fqn)) == fqn
    assert hf_name("layers.2.attention.wk.weight") == "model.layers.2.self_attn.k_proj.weight"
    with pytest.raises(SpecError, match="no counterpart"):
        hf_name("layers.0.attention.rotary.inv_freq")


def test_export_writes_safetensors_hugging_face_loads(tmp_path: Path) -> None:
    spec = get_preset("tiny-llama")
    plan = one_process(Case("", "tiny-llama", {})).plan(1)
    parallel = parallelize(meta_model("tiny-llama"), plan, seed=4).eval()
    checkpoint = parallel.save(tmp_path / "ckpt", step=0)
    out = export_hf(
        tmp_path / "ckpt", tmp_path / "hf", rename=hf_name, config=hf_llama_config(spec),
        max_shard_bytes=200_000,
    )  # fmt: skip
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {hf_name(f) for f in parallel.model_state.tensors}
    assert len(set(index["weight_map"].values())) > 1
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, spec.vocab_size, (2, SEQ))
    with torch.no_grad():
        assert torch.equal(hf(tokens).logits, parallel(tokens))
    with pytest.raises(SpecError, match="exists"):
        export_hf(checkpoint, out)
    assert not (tmp_path / "hf.partial").exists()


_KILLED_SAVE = """
import os, signal, sys
import torch.distributed.checkpoint.filesystem as filesystem
from pathlib import Path
from strategies.apply import parallelize
from tests.test_checkpoint import one_process, meta_model, Case
from tests.test_runtime_numerics import parameter_digests
import json

root = Path(sys.argv[1])
plan = one_process(Case("", "tiny-llama", {})).plan(1)
parallel = parallelize(meta_model("tiny-llama"), plan, seed=1)
parallel.save(root, step=1)
(root / "digests.json").write_text(json.dumps(parameter_digests(parallel)))
written = filesystem._write_item

def write_then_die(*args, **kwargs):
    result = written(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 with the second save half-written
    return result

filesystem._write_item = write_then_die
for param in parallel.parameters():
    param.data.add_(1.0)
parallel.save(root, step=2)
"""


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_latest(tmp_path: Path) -> None:
    script = tmp_path / "killed_save.py"
    script.write_text(textwrap.dedent(_KILLED_SAVE))
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script), str(root)], env=env, timeout=300)
    assert done.returncode == -signal.SIGKILL
    assert (root / "step-00000002.partial").is_dir()  # the half-written save
    assert any((root / "step-00000002.partial").iterdir())
    assert (root / LATEST).read_text().strip() == "step-00000001"
    plan = one_process(Case("", "tiny-llama", {})).plan(1)
    fresh = parallelize(meta_model("tiny-llama"), plan, seed=9)
    assert fresh.load(root) == 1
    assert parameter_digests(fresh) == json.loads((root / "digests.json").read_text())
    fresh.save(root, step=2)  # a later save replaces the stale partial one
    assert (root / LATEST).read_text().strip() == "step-00000002"
    assert not (root / "step-00000002.partial").exists()


# ---- several ranks


def _ilp(model: str) -> str | None:
    return None if model == "tiny-llama" else "ilp"


def _pairs(model: str) -> list[tuple[Case, Case]]:
    layout = _ilp(model)
    dp4 = Case("dp4", model, _per_rank(4))
    ddp_tp = Case("dp2 x tp2", model, _per_rank(2, tp=2), layout=layout)
    pp_dp = Case("pp2 x dp2 zero2", model, _per_rank(2, pp=2, zero=2, num_microbatches=2))
    fsdp4 = Case("fsdp4", model, _per_rank(4, zero=3))
    hsdp = Case("hsdp 2x2", model, _per_rank(4, zero=3, dp_shard=2))
    tp_fsdp = Case("tp2 x fsdp2", model, _per_rank(2, tp=2, zero=3), layout=layout)
    interleaved = Case(
        "pp2 interleaved x tp2", model,
        _per_rank(1, pp=2, tp=2, num_microbatches=4, schedule="interleaved-1f1b",
                  virtual_stages=2),
        layout=layout,
    )  # fmt: skip
    cp = Case("cp2 x fsdp2", model, _per_rank(2, cp=2, zero=3))
    return [
        (dp4, ddp_tp),
        (ddp_tp, pp_dp),
        (pp_dp, fsdp4),
        (fsdp4, hsdp),
        (tp_fsdp, interleaved),
        (interleaved, cp),
    ]


RESHARD = [
    *[(f"tiny-llama {a.name} -> {b.name}", a, b) for a, b in _pairs("tiny-llama")],
    *[(f"user-gpt {a.name} -> {b.name}", a, b) for a, b in _pairs("user-gpt")[:3]],
    *[(f"hf-llama {a.name} -> {b.name}", a, b) for a, b in _pairs("hf-llama")[:1]],
]


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_under_another_plan_continues_the_uninterrupted_run(tmp_path: Path) -> None:
    """Saved under plan A, resumed under plan B: the losses follow one process's
    uninterrupted run as closely as any plan does (1e-5; plans sum in other orders)."""
    tasks = {
        name: functools.partial(
            save_then_resume, before.planned(4), after.planned(4), tmp_path / f"ckpt{i}", 4
        )
        for i, (name, before, after) in enumerate(RESHARD)
    }
    results = run_on_ranks(4, tasks, tmp_path)
    failures = []
    for name, before, _ in RESHARD:
        losses = results[name][0]
        if isinstance(losses, str):
            failures.append(f"{name}: raised\n{losses}")
            continue
        expected = uninterrupted(before.model)
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        print(f"{name:<48} max |loss - uninterrupted, one process| = {worst:.2e}")
        if worst > RESHARD_BOUND:
            failures.append(f"{name}: losses {losses} vs uninterrupted {expected}")
    assert not failures, "\n".join(failures)


def load_and_train(case: Case, directory: str, world_size: int, rank: int) -> dict[str, Any]:
    """Gathered weights of ``case``'s model built on meta and loaded from ``directory``,
    and 4 steps' losses."""
    parallel = parallelize(meta_model(case.model), case.plan(world_size), weights=directory)
    weights = parameter_digests(parallel)
    trainer = Trainer(parallel, lr=LR, max_grad_norm=CLIP)
    return {"weights": weights, "losses": run_steps(parallel, trainer, rank, range(4))}


def _loads(model: str, layout: str | None) -> list[Case]:
    return [
        Case(f"{model} fsdp4", model, _per_rank(4, zero=3)),
        Case(f"{model} dp2 x tp2 (ddp over tp)", model, _per_rank(2, tp=2), layout=layout),
        Case(f"{model} tp2 x fsdp2", model, _per_rank(2, tp=2, zero=3), layout=layout),
        Case(f"{model} pp2 x dp2 zero2", model, _per_rank(2, pp=2, zero=2, num_microbatches=2)),
        Case(f"{model} cp2 x fsdp2", model, _per_rank(2, cp=2, zero=3)),
    ]


LOADS = [*_loads("tiny-llama", None), *_loads("hf-llama", "ilp")]


def hf_model_dir(directory: Path) -> Path:
    """The tests' Hugging Face Llama (``hf-llama``) with seeded weights, as safetensors in
    several files."""
    torch.manual_seed(3)
    model = build_handle("hf-llama").module
    model.save_pretrained(directory, max_shard_size="50KB")
    return directory


@pytest.mark.distributed
@pytest.mark.slow
def test_hugging_face_weights_load_sharded_and_train_as_one_process(tmp_path: Path) -> None:
    """Hugging Face safetensors into the zoo Llama (renamed) and into a Hugging Face Llama
    built on meta, under five plans on 4 ranks: the gathered weights equal one process's
    that loaded the same files, and so do the losses (1e-5)."""
    directories = {
        "tiny-llama": str(hf_llama_dir(tmp_path / "zoo", get_preset("tiny-llama"))),
        "hf-llama": str(hf_model_dir(tmp_path / "hf")),
    }
    expected = {
        model: load_and_train(one_process(Case("", model, {})), directory, 1, 0)
        for model, directory in directories.items()
    }
    tasks = {
        case.name: functools.partial(load_and_train, case.planned(4), directories[case.model], 4)
        for case in LOADS
    }
    check_loads(LOADS, run_on_ranks(4, tasks, tmp_path), expected, 1e-5)


def check_loads(
    cases: list[Any], results: dict[str, list[Any]], expected: dict[str, Any], bound: float
) -> None:
    """Each case's ranks (a case has ``name`` and ``model``) hold, gathered, the weights
    one process loaded, and its losses are within ``bound`` of that process's."""
    failures = []
    for case in cases:
        per_rank, reference = results[case.name], expected[case.model]
        raised = next((r for r in per_rank if isinstance(r, str)), None)
        if raised is not None:
            failures.append(f"{case.name}: raised\n{raised}")
            continue
        held = {name: d for result in per_rank for name, d in result["weights"].items()}
        if held != reference["weights"]:
            failures.append(f"{case.name}: loaded weights differ from one process's")
        worst = max(
            abs(a - b) for a, b in zip(per_rank[0]["losses"], reference["losses"], strict=True)
        )
        print(f"{case.name:<36} weights equal; max |loss - one process| = {worst:.2e}")
        if worst > bound:
            failures.append(f"{case.name}: losses {per_rank[0]['losses']} vs {reference}")
    assert not failures, "\n".join(failures)


# ---- memory while loading

BIG = ModelSpec(
    name="rss-llama", family="llama", num_layers=16, hidden_size=1024, num_heads=16,
    num_kv_heads=4, vocab_size=8192, seq_len=64,
)  # fmt: skip  # 200M parameters: 0.80 GB in fp32, 0.20 GB per rank at world 4
LOAD_OVERHEAD = 48 * 2**20  # bytes per rank beyond its shards and the largest tensor's copies
# Copies of the largest tensor a reader holds at once: safetensors maps the file, while DCP's
# FileSystemReader hands torch.load a Python stream, which reads the saved chunk as bytes and
# copies them into a storage before narrowing it to this rank's part.
LARGEST_COPIES = {"hugging face": 1, "checkpoint": 2}


def _plan_for(spec: ModelSpec, world_size: int, **strategy: Any) -> Any:
    from planner.assemble import assemble_plan
    from planner.models import ModelHandle, _token_inputs
    from planner.spec import Cluster, Strategy, Training

    handle = ModelHandle(spec.name, "tests", build(spec, device="meta"),
                         _token_inputs(spec.vocab_size, torch.device("meta")), spec)  # fmt: skip
    training = Training(global_batch_size=world_size, micro_batch_size=1, seq_len=spec.seq_len)
    cluster = Cluster(gpu="cpu", num_gpus=world_size, gpus_per_node=world_size)
    return assemble_plan(handle, cluster, training, Strategy(micro_batch_size=1, **strategy))


def _resident_bytes(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    line = next(line for line in text.splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def load_peak(source: str, world_size: int, rank: int) -> dict[str, int]:
    """Peak resident memory above the start while ``BIG`` is built on meta and its weights
    loaded from ``source`` under FSDP; this rank's shard and the largest tensor."""
    plan = _plan_for(BIG, world_size, dp=world_size, zero=3)
    model = build(BIG, device="meta")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from now
    start = _resident_bytes("VmRSS")
    parallel = parallelize(model, plan, weights=source)
    peak = _resident_bytes("VmHWM") - start
    tensors = parallel.model_state.tensors.values()
    shard = sum(local_part(t)[0].numel() * t.element_size() for t in tensors)
    largest = max(t.numel() * t.element_size() for t in tensors)
    return {"peak": peak, "shard": shard, "largest": largest}


@pytest.mark.distributed
@pytest.mark.slow
def test_loading_holds_a_rank_to_its_shard_plus_one_tensor(tmp_path: Path) -> None:
    hf = hf_llama_dir(tmp_path / "hf", BIG, max_shard_size="100MB")
    one = parallelize(build(BIG, device="meta"), _plan_for(BIG, 1), weights=hf)
    checkpoint = one.save(tmp_path / "dcp", step=0)
    model_bytes = sum(t.numel() * t.element_size() for t in one.model_state.tensors.values())
    del one
    sources = {"hugging face": str(hf), "checkpoint": str(checkpoint)}
    tasks = {name: functools.partial(load_peak, path, 4) for name, path in sources.items()}
    results = run_on_ranks(4, tasks, tmp_path)
    failures = []
    for name in sources:
        for rank, figures in enumerate(results[name]):
            if isinstance(figures, str):
                failures.append(f"{name}: raised\n{figures}")
                continue
            bound = figures["shard"] + LARGEST_COPIES[name] * figures["largest"] + LOAD_OVERHEAD
            print(
                f"{name:<13} rank {rank}: peak {figures['peak'] / 2**20:.0f} MiB above start; "
                f"shard {figures['shard'] / 2**20:.0f} MiB, largest tensor "
                f"{figures['largest'] / 2**20:.0f} MiB, model {model_bytes / 2**20:.0f} MiB"
            )
            if figures["peak"] > bound:
                failures.append(f"{name} rank {rank}: peak {figures['peak']} > {bound}")
    assert not failures, "\n".join(failures)


# ---- resuming under the same plan

POWERSGD = {"kind": "powersgd", "rank": 2, "warmup_steps": 2}
LOCAL_SGD = {"kind": "local_sgd", "warmup_steps": 2, "period": 4, "local_group": 2}
SAME_PLAN = [
    Case("hf-llama dp2 x tp2 (ddp over tp)", "hf-llama", _per_rank(2, tp=2), layout="ilp"),
    Case("user-gpt pp2 1f1b x dp2 zero2", "user-gpt",
         _per_rank(2, pp=2, zero=2, num_microbatches=2)),
    Case("tiny-llama pp2 interleaved x tp2", "tiny-llama",
         _per_rank(1, pp=2, tp=2, num_microbatches=4, schedule="interleaved-1f1b",
                   virtual_stages=2)),
    Case("tiny-llama cp2 x fsdp2", "tiny-llama", _per_rank(2, cp=2, zero=3)),
    Case("ddp4 powersgd r2", "tiny-llama", _per_rank(4, compression=POWERSGD)),
    Case("ddp4 local sgd", "tiny-llama", _per_rank(4, compression=LOCAL_SGD)),
]  # fmt: skip


def same_plan_run(case: Case, directory: Path | None, world_size: int, rank: int) -> list[float]:
    """``TOTAL`` steps of ``case`` in one go (no ``directory``), or saved after
    ``SAVED_AT`` steps and resumed in a new model from ``directory``."""
    if directory is None:
        parallel = parallelize(meta_model(case.model), case.plan(world_size), seed=1)
        trainer = Trainer(parallel, lr=LR, max_grad_norm=CLIP)
        return run_steps(parallel, trainer, rank, range(TOTAL))
    return save_then_resume(case, case, directory, world_size, rank)


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_under_the_same_plan_continues_the_same_run(tmp_path: Path) -> None:
    """A resume restores everything a step depends on: under the same plan the losses
    equal the uninterrupted run's on the same ranks (1e-6). That includes local SGD (each
    rank's own replica and optimizer state, the iteration and the averaging step); PowerSGD
    keeps compressing (its iteration carries over) with its error feedback restarted, so
    it stays close."""
    tasks = {}
    for i, case in enumerate(SAME_PLAN):
        tasks[f"{case.name} uninterrupted"] = functools.partial(
            same_plan_run, case.planned(4), None, 4
        )
        tasks[case.name] = functools.partial(same_plan_run, case.planned(4), tmp_path / f"c{i}", 4)
    results = run_on_ranks(4, tasks, tmp_path)
    failures = []
    for case in SAME_PLAN:
        resumed, whole = results[case.name][0], results[f"{case.name} uninterrupted"][0]
        if isinstance(resumed, str) or isinstance(whole, str):
            failures.append(
                f"{case.name}: raised\n{resumed if isinstance(resumed, str) else whole}"
            )
            continue
        worst = max(abs(a - b) for a, b in zip(resumed, whole, strict=True))
        print(f"{case.name:<36} max |loss - uninterrupted, same plan| = {worst:.2e}")
        bound = POWERSGD_RESUME_BOUND if "powersgd" in case.name else RESUME_BOUND
        if worst > bound or resumed[:SAVED_AT] != whole[:SAVED_AT]:
            failures.append(f"{case.name}: resumed {resumed} vs uninterrupted {whole}")
    assert not failures, "\n".join(failures)
