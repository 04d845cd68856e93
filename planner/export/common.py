"""Checks and facts every export shares: refusals, recompute, stage split, TP layout.

Each target framework takes less than a :class:`~planner.spec.Plan` says. What it
cannot express raises :class:`~planner.errors.ExportError` naming the plan field,
its value, why the target cannot carry it and what to change, rather than dropping
something that changes the math or the memory.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import Enum

from planner.errors import ExportError
from planner.frameworks import (
    Framework,
    Target,
    model_refusal,
    other_takers,
    parse_target,
    run_refusal,
)
from planner.spec import ModelSpec, Plan, RecomputeMode, TPStyle

__all__ = [
    "selective_recompute_note",
    "refuse",
    "header",
    "seq_len",
    "check_target",
    "described_model",
    "blocks_per_chunk",
    "check_recompute_blocks",
    "zoo_layers_per_chunk",
    "check_megatron_layout",
]

_BLOCK = re.compile(r"\.(\d+)$")  # a repeated block: an FQN ending in its index
_ZOO_LAYER = re.compile(r"^layers\.(\d+)$")
_ZOO_FIRST = ("tok_embeddings", "pos_embeddings")
_ZOO_LAST = ("norm", "output")

# Megatron-LM's (and torchtitan's llama) tensor-parallel layout of the zoo transformer.
_MEGATRON_STYLES = {
    "layers.*.attention.wq": TPStyle.COLWISE,
    "layers.*.attention.wk": TPStyle.COLWISE,
    "layers.*.attention.wv": TPStyle.COLWISE,
    "layers.*.attention.wo": TPStyle.ROWWISE,
    "layers.*.feed_forward.w1": TPStyle.COLWISE,
    "layers.*.feed_forward.w3": TPStyle.COLWISE,
    "layers.*.feed_forward.w2": TPStyle.ROWWISE,
    # multi-head latent attention: the up-projections split by head (down-projections,
    # norms replicated), as Megatron-Core's MLA; the shared experts as a dense MLP. The
    # router and routed experts are replicated (expert tensor parallelism 1).
    "layers.*.attention.wq_b": TPStyle.COLWISE,
    "layers.*.attention.wkv_b": TPStyle.COLWISE,
    "layers.*.feed_forward.shared_experts.w1": TPStyle.COLWISE,
    "layers.*.feed_forward.shared_experts.w3": TPStyle.COLWISE,
    "layers.*.feed_forward.shared_experts.w2": TPStyle.ROWWISE,
    "output": TPStyle.COLWISE,
}
# norms run whole on every rank (their weights replicated), on a sequence shard or not;
# per-head query/key norms (Qwen3's, Megatron's --qk-layernorm) on their heads' shard
_NORMS = (
    "layers.*.attention_norm", "layers.*.ffn_norm", "norm", "layers.*.attention.q_norm",
    "layers.*.attention.k_norm", "layers.*.attention.kv_norm",
)  # fmt: skip
# Same parameter bytes per rank either way; only the collective after the lookup differs.
_EMBEDDING_STYLES = (TPStyle.VOCAB_PARALLEL, TPStyle.COLWISE)


def _show(value: object) -> str:
    if isinstance(value, Enum):
        return repr(value.value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(item) for item in value) + ")"
    return repr(value)


def refuse(target: str, field: str, value: object, why: str, fix: str) -> ExportError:
    """An :class:`ExportError` that reads ``cannot export to T: field = value: why; fix``."""
    return ExportError(f"cannot export to {target}: {field} = {_show(value)}: {why}; {fix}")


def header(
    plan: Plan, target: Target, form: str, environment: Sequence[str] = (), comment: str = "#"
) -> list[str]:
    """Comment lines naming the plan an export came from, the release it targets (``form``:
    what the file is to that release) and the launch environment it needs, one
    ``env: NAME=VALUE (why)`` line per variable (``env: none``)."""
    return [
        f"{comment} {target.framework.value} settings for {plan.model_name} on "
        f"{plan.strategy.world_size} GPUs ({plan.cluster.gpu}), written by 'plan export' "
        f"(planner {plan.planner_version})",
        f"{comment} target: {target}: {form}",
        *[f"{comment} env: {item}" for item in environment or ["none"]],
        f"{comment} strategy: {plan.strategy.describe()}",
    ]


def seq_len(plan: Plan) -> int | None:
    """Training sequence length in tokens (the model's when training does not set one)."""
    if plan.training.seq_len is not None:
        return plan.training.seq_len
    return plan.model.seq_len if plan.model is not None else None


def selective_recompute_note(plan: Plan, framework: Framework, policy: str) -> list[str]:
    """A note where the plan's selective recompute was priced as another framework's than
    ``framework``'s (``policy``: what its selective recompute keeps)."""
    planned = parse_target(plan.target, field="plan.target").framework
    if plan.strategy.recompute is not RecomputeMode.SELECTIVE or planned is framework:
        return []
    return [
        f"selective recompute: {policy}; the plan priced {planned.value}'s (plan --for "
        f"{framework.value} prices {framework.value}'s, and plan estimate --from this file "
        "prices what it runs)"
    ]


def check_target(plan: Plan, target: Target) -> None:
    """Refuse what ``target`` cannot run (:mod:`planner.frameworks`, the rules the
    search restricts itself with under ``--for``)."""
    refusal = model_refusal(target, plan.model)  # a traced model: only where no model is built
    if refusal is not None:
        raise refuse(target.framework.value, refusal.field, refusal.value, refusal.why, refusal.fix)
    refusal = run_refusal(target, plan.model, plan.strategy, plan.training)
    if refusal is not None:
        takers = other_takers(target, plan.model, plan.strategy, plan.training)
        fix = refusal.fix + _elsewhere(takers)
        raise refuse(target.framework.value, refusal.field, refusal.value, refusal.why, fix)


def _elsewhere(takers: Sequence[Framework]) -> str:
    """Where the plan runs as it is: the export targets among ``takers``, else this runtime."""
    exports = [framework.value for framework in takers if framework is not Framework.PLANNER]
    if exports:
        return f", or export it to {' or '.join(exports)} as it is"
    if Framework.PLANNER in takers:
        return ", or run it as it is with this runtime (plan run, planner.parallelize)"
    return ""


def described_model(plan: Plan) -> ModelSpec:
    """The model description of a plan :func:`check_target` let through to a framework that
    builds its own transformer (torchtitan, Megatron-LM): never a traced model."""
    assert plan.model is not None, "check_target refuses traced models for this target"
    return plan.model


def blocks_per_chunk(plan: Plan) -> list[int] | None:
    """Repeated blocks in each model chunk (one chunk without pipelining); None if unknown."""
    if plan.stages:
        return [sum(bool(_BLOCK.search(fqn)) for fqn in chunk) for chunk in plan.stages]
    if plan.model is not None:
        return [plan.model.num_layers]
    return None


def check_recompute_blocks(plan: Plan, target: str) -> None:
    """Refuse ``recompute_blocks = k`` when it leaves some block of a chunk stored.

    ``k`` at least the blocks of every chunk recomputes them all, which any target says.
    """
    limit = plan.strategy.recompute_blocks
    if limit is None:
        return
    counts = blocks_per_chunk(plan)
    if counts is not None and limit >= max(counts):
        return
    raise refuse(
        target,
        "strategy.recompute_blocks",
        limit,
        f"{target} recomputes every block or none, not the first {limit} of each chunk "
        f"(blocks per chunk: {counts if counts is not None else 'unknown'})",
        "drop recompute_blocks (recompute all blocks) or export to megatron "
        "(--recompute-method block)",
    )


def zoo_layers_per_chunk(plan: Plan, target: str) -> list[int]:
    """Transformer layers in each of ``plan.stages``, checked to be the zoo's contiguous split.

    Frameworks that build their own transformer split it by layer counts, embeddings on
    the first chunk and the final norm and head on the last; any other split is refused.
    """
    counts: list[int] = []
    expected = 0
    last = len(plan.stages) - 1
    for index, chunk in enumerate(plan.stages):
        layers = 0
        for fqn in chunk:
            match = _ZOO_LAYER.match(fqn)
            if match is None:
                _check_edge_module(plan, target, index, fqn, first=index == 0, last=index == last)
                continue
            if int(match.group(1)) != expected:
                raise refuse(
                    target,
                    f"plan.stages[{index}]",
                    chunk,
                    f"{fqn!r} breaks the contiguous layer order (layers.{expected} expected); "
                    f"{target} gives every pipeline chunk consecutive layers",
                    "re-plan so that each chunk holds consecutive layers",
                )
            expected += 1
            layers += 1
        counts.append(layers)
    return counts


def _check_edge_module(
    plan: Plan, target: str, index: int, fqn: str, *, first: bool, last: bool
) -> None:
    if (fqn in _ZOO_FIRST and first) or (fqn in _ZOO_LAST and last):
        return
    where = (
        "it is not a layer of the zoo transformer"
        if fqn not in _ZOO_FIRST + _ZOO_LAST
        else "embeddings belong to the first chunk and the final norm and head to the last"
    )
    raise refuse(
        target,
        f"plan.stages[{index}]",
        plan.stages[index],
        f"{fqn!r}: {where}, and {target} places only its own transformer's modules",
        "export a plan made for a zoo preset or ModelSpec file with its planner stage split",
    )


def check_megatron_layout(plan: Plan, target: str) -> list[str]:
    """Check ``plan.tp_layout`` is Megatron's (as torchtitan's llama plan) and return notes.

    Attention ``wq/wk/wv`` and FFN ``w1/w3`` column-parallel, ``wo/w2`` row-parallel, the
    head column-parallel, norms sequence-parallel or replicated; the token embedding
    sharded on the vocabulary, or on the embedding dim (same memory, noted).
    """
    if not plan.tp_layout and plan.model is not None:  # this runtime could not lay it out
        return [
            f"tensor-parallel layout: {target}'s own (the plan was made for {plan.target}, "
            "whose layout of the model's layers the cost model priced)"
        ]
    notes: list[str] = []
    for key, module in sorted(plan.tp_layout.items()):
        style = module.style
        if style is TPStyle.BOUNDARY:  # where sequence parallelism starts: not a module style
            continue
        pattern = re.sub(r"^layers\.\d+\.", "layers.*.", key)
        if pattern == "tok_embeddings" and style in _EMBEDDING_STYLES:
            if style is TPStyle.COLWISE:
                notes.append(
                    f"tok_embeddings: the plan shards it on the embedding dim; {target} shards "
                    "it on the vocabulary (same bytes per rank, another collective)"
                )
            continue
        if pattern in _NORMS and style in (TPStyle.SEQUENCE_PARALLEL, TPStyle.REPLICATE):
            continue
        if _MEGATRON_STYLES.get(pattern) is style or (
            style is TPStyle.REPLICATE and pattern not in _MEGATRON_STYLES
        ):
            continue
        raise _layout_refusal(plan, target, key, style)
    present = {re.sub(r"^layers\.\d+\.", "layers.*.", key) for key in plan.tp_layout}
    for pattern in (*_required(plan), "tok_embeddings", "output"):
        if pattern not in present:
            raise _layout_refusal(plan, target, pattern, None)
    return notes


def _required(plan: Plan) -> tuple[str, ...]:
    """Modules a Megatron layout of this model shards: the query and output projections
    and a feed-forward (dense, else the shared experts; routed experts are not split)."""
    spec = plan.model
    query = "wq_b" if spec is not None and spec.q_lora_rank is not None else "wq"
    required = (f"layers.*.attention.{query}", "layers.*.attention.wo")
    if spec is None or spec.dense_layers or not spec.moe:
        return (*required, "layers.*.feed_forward.w1")
    if spec.num_shared_experts:
        return (*required, "layers.*.feed_forward.shared_experts.w1")
    return required


def _layout_refusal(plan: Plan, target: str, key: str, style: TPStyle | None) -> ExportError:
    pattern = re.sub(r"^layers\.\d+\.", "layers.*.", key)
    expected = _MEGATRON_STYLES.get(
        pattern, TPStyle.VOCAB_PARALLEL if pattern == "tok_embeddings" else TPStyle.REPLICATE
    )
    return refuse(
        target,
        f"plan.tp_layout[{key!r}]",
        style if style is not None else "(missing)",
        f"{target} shards transformer layers only Megatron's way ({key} {expected.value}); "
        f"this layout (model {plan.model_name!r}) differs",
        "export a plan for a zoo transformer, or run this layout with 'plan run'",
    )
