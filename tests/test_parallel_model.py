"""What ``planner.parallelize`` returns, in one process: it knows its plan, cuts global
batches, refuses inputs of the wrong shape with the fix, guards stock clipping; and
``--seq`` re-traces a user module at that length."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import planner
from planner.assemble import assemble_plan
from planner.errors import SpecError
from planner.models import resolve_model
from planner.spec import Cluster, Strategy, Training
from planner.tracing import trace
from strategies import clipping
from strategies.mesh import dp_rank_of
from strategies.parallel_model import ParallelModel, local_slice, sequence_shards
from tests.test_runtime_numerics import TinyLM

USER_GPT = "tests.user_models:gpt"


def _parallel(batch: int = 8, seq: int = 16, dtype: str = "fp32") -> ParallelModel:
    model = resolve_model("tiny-gpt", device="cpu", seed=0).module
    training = Training(global_batch_size=batch, micro_batch_size=batch, seq_len=seq, dtype=dtype)
    cluster = Cluster(gpu="cpu", num_gpus=1, gpus_per_node=1)
    plan = assemble_plan(
        resolve_model("tiny-gpt"), cluster, training, Strategy(micro_batch_size=batch)
    )
    return planner.parallelize(model, plan)


def test_the_parallel_model_knows_its_plan_and_steps_like_the_model() -> None:
    parallel = _parallel()
    assert parallel.plan.training.global_batch_size == 8
    assert (parallel.dp_size, parallel.dp_rank) == (1, 0)
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = parallel.local_batch(tokens[:, :-1], tokens[:, 1:])
    assert inputs.shape == (8, 16)
    loss = parallel.step(inputs, targets)
    expected = torch.nn.functional.cross_entropy(parallel(inputs).flatten(0, 1), targets.flatten())
    assert float(loss) == pytest.approx(float(expected.detach()), abs=1e-6)
    norm = parallel.clip_grad_norm_(1e-3)
    clipped = torch.sqrt(sum(p.grad.pow(2).sum() for p in parallel.parameters()))
    assert float(norm) > 1e-3 and float(clipped) == pytest.approx(1e-3, rel=1e-3)


def test_calling_the_model_yourself_runs_in_the_plans_precision() -> None:
    """``parallel(inputs)`` computes under the plan's autocast and ``loss_context`` adds it
    around the loss, so the loop that calls the model itself trains as ``step`` does
    (what was priced: bf16 activations, not fp32)."""
    parallel = _parallel(dtype="bf16")
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = parallel.local_batch(tokens[:, :-1], tokens[:, 1:])
    loss = parallel.step(inputs, targets)
    stepped = [p.grad.clone() for p in parallel.parameters()]
    for p in parallel.parameters():
        p.grad = None
    logits = parallel(inputs)
    assert logits.dtype is torch.bfloat16
    with parallel.loss_context():
        mine = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        mine.backward()
    assert float(mine.detach()) == pytest.approx(float(loss), abs=1e-6)
    for grad, p in zip(stepped, parallel.parameters(), strict=True):
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=1e-6)


def test_a_batch_that_is_not_the_global_batch_names_the_fix() -> None:
    parallel = _parallel()
    with pytest.raises(SpecError, match=r"global_batch_size = 8: pass the whole global batch"):
        parallel.local_batch(torch.zeros(4, 16, dtype=torch.long))


def test_a_step_on_the_wrong_batch_fails_before_training() -> None:
    parallel = _parallel()
    with pytest.raises(SpecError, match=r"inputs have batch 16 .* is 8 sequences; cut each"):
        parallel.step(torch.zeros(16, 16, dtype=torch.long), torch.zeros(16, 16, dtype=torch.long))


def test_a_model_returning_the_last_positions_logits_cannot_be_stepped() -> None:
    """nanoGPT's forward without targets returns ``(logits of the last position, None)``:
    the loss says so, instead of an assertion or a shape error from cross entropy."""
    from tests.test_pipeline_any_model import _LM

    module = _LM("last position")
    training = Training(global_batch_size=4, micro_batch_size=4, seq_len=8, dtype="fp32")
    parallel = planner.parallelize(
        module, cluster=Cluster(gpu="h100-sxm-80gb", num_gpus=1), training=training
    )
    tokens = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(SpecError, match=r"logits of shape \(4, 1, 64\) .* loss_fn=") as caught:
        parallel.step(tokens, tokens)
    assert "return the logits of every position" in str(caught.value)


def test_a_loader_sharded_by_dp_rank_gets_the_same_shards_as_local_batch() -> None:
    """dp 2 x cp 2: each rank's dp share (as a DistributedSampler by dp_rank gives it) cut
    by sequence_shards equals local_batch's cut of the global batch."""
    training = Training(global_batch_size=8, micro_batch_size=4, seq_len=16, dtype="fp32")
    cluster = Cluster(gpu="cpu", num_gpus=4, gpus_per_node=4)
    plan = assemble_plan(
        resolve_model("tiny-gpt"), cluster, training, Strategy(dp=2, cp=2, micro_batch_size=4)
    )
    tokens = torch.arange(8 * 16).view(8, 16)
    for rank in range(4):
        (share,) = local_slice(plan, rank, tokens)
        dp_share = tokens.chunk(2)[dp_rank_of(plan, rank)]
        (cut,) = sequence_shards(plan, rank, dp_share)
        assert share.shape == (4, 8) and torch.equal(cut, share)


def test_a_sequence_shard_of_the_wrong_batch_names_the_fix() -> None:
    parallel = _parallel(batch=8)
    with pytest.raises(SpecError, match=r"is 8 sequences: pass this rank's share"):
        parallel.sequence_shard(torch.zeros(16, 16, dtype=torch.long))
    (same,) = parallel.sequence_shard(torch.ones(8, 16))
    assert same.shape == (8, 16)


def test_a_forward_on_more_than_this_ranks_share_fails() -> None:
    parallel = _parallel(batch=4)
    with pytest.raises(SpecError, match=r"parallel\(inputs\): inputs have batch 8"):
        parallel(torch.zeros(8, 16, dtype=torch.long))


def test_stock_clipping_of_guarded_parameters_raises_with_the_fix() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    other = torch.nn.Parameter(torch.ones(3))
    other.grad = torch.ones(3)
    clipping.guard_stock_clipping([weight], "pipeline stages (pp = 2) each see only theirs")
    with pytest.raises(SpecError, match=r"pp = 2\) each see only theirs.*parallel.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_([other, weight], 1.0)
    norm = torch.nn.utils.clip_grad_norm_([other], 1.0)  # unguarded parameters: stock
    assert float(norm) == pytest.approx(3**0.5)


@pytest.mark.parametrize(
    ("pp", "tp", "problem"),
    [(1, 1, None), (2, 1, "pipeline stages"), (1, 2, "tensor-parallel shards"), (2, 2, "pipeline")],
)
def test_stock_clipping_is_guarded_where_it_would_be_wrong(pp, tp, problem) -> None:
    found = clipping.stock_clipping_problem(pp, tp)
    assert (found is None) if problem is None else (problem in found)


def _forward_flops(seq_len: int | None) -> float:
    return trace(resolve_model(USER_GPT), batch_size=1, seq_len=seq_len).flops_fwd


def test_seq_retraces_a_user_module_at_that_length() -> None:
    """tests.user_models:gpt's example inputs are 16 tokens; at 64 the linear layers do 4x
    the work and attention more (the old trace kept 16 and priced 4x the tokens/s)."""
    native, longer = _forward_flops(None), _forward_flops(64)
    assert graph_seq(None) == 16 and graph_seq(64) == 64
    assert longer / native > 4.0


def graph_seq(seq_len: int | None) -> int:
    return trace(resolve_model(USER_GPT), batch_size=1, seq_len=seq_len).seq_len


def test_seq_on_a_model_without_token_ids_names_the_fix() -> None:
    with pytest.raises(SpecError, match=r"seq_len = 32.*takes no token ids.*example_inputs"):
        trace(resolve_model("mlp"), batch_size=1, seq_len=32)


def test_example_inputs_taking_seq_len_are_asked_for_it() -> None:
    class Sized(TinyLM):
        def example_inputs(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor]:  # type: ignore[override]
            return (torch.zeros(batch_size, seq_len, dtype=torch.long),)

    handle = planner.models.handle_for_module(Sized())
    assert handle.make_inputs(2, 48)[0].shape == (2, 48)


def test_one_shot_plans_a_hugging_face_model_at_the_training_length() -> None:
    """No example_inputs needed: the plan is made at ``training.seq_len`` and returned."""
    from tests.test_runtime_numerics import build_handle

    model = build_handle("hf-qwen2").module
    training = Training(global_batch_size=4, seq_len=48, dtype="fp32")
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=1)
    parallel = planner.parallelize(model, cluster=cluster, training=training)
    assert parallel.plan.seq_len == 48 and parallel.module is model
    tokens = torch.randint(0, 256, (4, 49))
    loss = parallel.step(*parallel.local_batch(tokens[:, :-1], tokens[:, 1:]))
    assert torch.isfinite(loss)


class _NormedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def test_batch_norms_under_data_parallelism_say_they_normalise_per_rank(caplog) -> None:
    """Each data-parallel rank's batch norm sees its own micro-batch, as under DDP: a
    model with one does not match one process, and the check says so and how to."""
    from planner.models import ModelHandle
    from planner.modules import check_model_against_plan

    handle = ModelHandle("user", "test", _NormedMLP(), lambda b, s: (torch.randn(b, 8),))
    cluster, training = Cluster(gpu="cpu", num_gpus=2), Training(global_batch_size=8)
    plan = assemble_plan(handle, cluster, training, Strategy(dp=2, micro_batch_size=4))
    check_model_against_plan(plan, handle.module)
    assert "batch norm 'norm' normalises over each rank's micro-batch of 4 samples" in caplog.text
    assert "convert_sync_batchnorm" in caplog.text
    caplog.clear()
    one = assemble_plan(handle, cluster.with_gpus(1), training, Strategy(micro_batch_size=8))
    check_model_against_plan(one, handle.module)
    assert "batch norm" not in caplog.text


class _DropoutLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.embed(tokens)))

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor]:
        return (torch.zeros(batch_size, 8, dtype=torch.long),)


def test_a_module_without_example_inputs_planned_in_one_shot_names_the_fix() -> None:
    training = Training(global_batch_size=4, micro_batch_size=2, seq_len=8, dtype="fp32")
    module = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    with pytest.raises(SpecError, match=r"Sequential has no example inputs .* \(token ids of"):
        planner.parallelize(
            module, cluster=Cluster(gpu="h100-sxm-80gb", num_gpus=1), training=training
        )


def test_evaluate_is_the_eval_mode_loss_without_gradients_and_keeps_the_mode() -> None:
    """``evaluate`` turns dropout off for its forward, builds no graph, leaves no gradient
    and hands the model back in the mode it found it; the batch is step's."""
    torch.manual_seed(0)
    module = _DropoutLM()
    training = Training(global_batch_size=4, micro_batch_size=2, seq_len=8, dtype="fp32")
    parallel = planner.parallelize(
        module, cluster=Cluster(gpu="h100-sxm-80gb", num_gpus=1), training=training
    )
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    inputs, targets = parallel.local_batch(tokens[:, :-1], tokens[:, 1:])
    loss = parallel.evaluate(inputs, targets)
    assert parallel.training and not loss.requires_grad
    assert all(p.grad is None for p in parallel.parameters())
    module.eval()
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(
            module(inputs).flatten(0, 1), targets.flatten()
        )
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    assert float(parallel.evaluate(inputs, targets)) == float(loss)  # no dropout: the same
    with pytest.raises(
        SpecError, match=r"parallel.evaluate\(inputs, targets\): inputs have batch 2"
    ):
        parallel.evaluate(inputs[:2], targets[:2])


@pytest.mark.parametrize(
    ("strategy", "shape", "message"),
    [
        (
            Strategy(pp=2, num_microbatches=2, micro_batch_size=2),
            (4, 8),
            r"pipeline stages run sequences of the plan's seq_len, 16 tokens: give sequences",
        ),
        (
            Strategy(cp=2, micro_batch_size=4),
            (4, 4),
            r"context parallel over cp\(2\) cuts sequences of the plan's seq_len, 16 tokens "
            r"\(8 tokens on each rank",
        ),
        (Strategy(cp=2, micro_batch_size=4), (4, 16), r"each rank holds 8 of the 16 tokens"),
        (
            Strategy(tp=2, sequence_parallel=True, micro_batch_size=4),
            (4, 15),
            r"inputs have shape \(4, 15\): seq_len 15 / cp\(1\) = 15 tokens per rank is not "
            r"divisible by tp\(2\).* \(pad the sequences, or plan with --no-sequence-parallel\)",
        ),
    ],
)
def test_sequences_of_another_length_are_refused_where_the_plan_fixes_it(
    strategy: Strategy, shape: tuple[int, int], message: str
) -> None:
    """Pipeline stages pass on activations of their first call's shape (another length
    aborted the job in gloo or left ranks waiting), context parallelism cuts the plan's
    sequences, and sequence parallelism splits any length over tp (a length it cannot
    split aborted gloo): each refuses what it cannot run on every rank, before any
    transfer."""
    training = Training(global_batch_size=4, seq_len=16, dtype="fp32")
    cluster = Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2)
    plan = assemble_plan(resolve_model("tiny-gpt"), cluster, training, strategy)
    module = resolve_model("tiny-gpt", device="cpu", seed=0).module
    parallel = ParallelModel(plan, module, mesh=None, loss_fn=torch.nn.functional.cross_entropy)
    tokens = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(SpecError, match=message):
        parallel.evaluate(tokens, tokens)


def test_loss_contexts_nest() -> None:
    """A forward inside ``loss_context()`` enters loss parallel again (``parallel(inputs)``
    does, for models that compute their loss in forward): the inner exit keeps the outer
    context's loss operators, and the outer exit removes them once."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    from strategies.parallel_model import loss_context

    handlers = DTensor._op_dispatcher._custom_op_handlers
    plan = SimpleNamespace(loss_parallel=True)  # a plan whose head hands on sharded logits
    with loss_context(plan):
        with loss_context(plan):
            assert all(op in handlers for op in customized_loss_ops)
        assert all(op in handlers for op in customized_loss_ops)
    assert not any(op in handlers for op in customized_loss_ops)
