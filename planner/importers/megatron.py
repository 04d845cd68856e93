"""Megatron-LM command-line arguments read as the run the planner prices.

The text is what ``plan export --to megatron`` writes (one option per line, ``#``
comments) or a shell command (``torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py
--tensor-model-parallel-size 2 ...``, lines joined with ``\\``); option names as
Megatron-LM's ``megatron/training/arguments.py`` (Megatron-Core 0.14-0.16) defines them,
with its defaults for what is absent. The data-parallel size is what is left of the world
(``world / (tp x pp x cp)``), so the GPU count comes from ``torchrun``'s
``--nproc_per_node x --nnodes`` or from the options.

Read: the parallel sizes, ``--sequence-parallel``, the virtual pipeline
(``--num-layers-per-virtual-pipeline-stage``, ``--num-virtual-stages-per-pipeline-rank``,
``--pipeline-model-parallel-layout``) and uneven first/last stages, micro and global
batch, sequence length, the network-size arguments (a model without ``--model``; the
vocabulary padded to ``--make-vocab-size-divisible-by x tp`` as Megatron-LM pads it),
recompute, the distributed optimizer (ZeRO-1, hybrid with
``--num-distributed-optimizer-instances``), Megatron-FSDP (ZeRO-2/3), precision and
gradient-reduction dtype, optimizer, gradient clipping, and what the cost options
describe: ``--overlap-grad-reduce``, ``--overlap-param-gather`` (Megatron-LM overlaps
only when asked), ``--tp-comm-overlap``, ``--fp8-param-gather``, ``--fp8-recipe``
(delayed or tensorwise) and dropout (0.1 unless set); mixture of experts
(``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size``,
``--moe-shared-expert-intermediate-size``, leading dense blocks from ``--moe-layer-freq``,
``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``) and multi-head
latent attention (``--kv-lora-rank``, ``--q-lora-rank``, ``--qk-head-dim``,
``--qk-pos-emb-head-dim``, ``--v-head-dim``). Refused: what the planner does not price
(offloading, multi-token prediction, batch-size ramp-up, uniform recompute of layer
groups...) and experts other than ours (tensor-parallel experts without expert
parallelism, capacity factors that drop tokens, pre-softmax or scaled routing, an EP dispatcher
other than all-to-all).
"""

from __future__ import annotations

import re
from typing import Any

from planner.cost.options import GradAccumulation, RecomputeModule, SelectivePolicy
from planner.errors import SpecError
from planner.export.megatron import DTYPE_ARGS, SHARDING
from planner.frameworks import (
    KERNELS,
    MEGATRON_HALF_REDUCTION,
    MEGATRON_VOCAB_MULTIPLE,
    Framework,
    megatron_padded_vocab,
)
from planner.importers.common import (
    ImportedRun,
    Options,
    Settings,
    build_run,
    choose_model,
    chunks_of,
    command_words,
    launched_world,
    matching_preset,
    option_values,
    resolve_world,
)
from planner.spec import (
    Activation,
    CompressionKind,
    DType,
    Family,
    ModelSpec,
    Optimizer,
    RecomputeMode,
    Schedule,
    load_document,
)

__all__ = ["FORMAT", "even_split", "read_megatron"]

FORMAT = "megatron"
# Megatron-LM's store_true options that the importer reads or refuses (they take no value).
_FLAGS = frozenset({
    "--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp", "--bf16",
    "--fp16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32", "--swiglu",
    "--group-query-attention", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--no-gradient-accumulation-fusion", "--overlap-grad-reduce",
    "--overlap-param-gather", "--tp-comm-overlap", "--recompute-activations",
    "--use-rotary-position-embeddings", "--distribute-saved-activations", "--use-torch-fsdp2",
    "--optimizer-cpu-offload", "--cpu-offloading", "--multi-latent-attention",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--fp8-param-gather", "--moe-grouped-gemm", "--moe-router-pre-softmax", "--qk-layernorm",
    "--moe-enable-deepep", "--moe-router-force-load-balancing",
})  # fmt: skip
# --moe-flex-dispatcher-backend values (and --moe-enable-deepep, its older spelling): both
# send a token once per rank and node it is bound for (CostOptions.ep_dedup)
_DEDUPLICATING_BACKENDS = ("deepep", "hybridep")
# Options that change what a step computes or keeps, unpriced: option -> (harmless values, why).
_UNPRICED: dict[str, tuple[tuple[Any, ...], str]] = {
    "--use-torch-fsdp2": ((None,), "the importer reads Megatron-FSDP (--use-megatron-fsdp), "
                          "not the torch FSDP2 path"),
    "--optimizer-cpu-offload": ((None,), "the planner does not model CPU offload"),
    "--cpu-offloading": ((None,), "the planner does not model CPU offload"),
    "--distribute-saved-activations": ((None,), "activations split over tensor-parallel ranks "
                                       "are not priced"),
    "--mtp-num-layers": ((None, "0"), "multi-token prediction layers are not priced"),
    "--rampup-batch-size": ((None,), "the planner prices one batch size per step"),
    "--moe-expert-capacity-factor": ((None,), "the planner's experts are dropless (every routed "
                                     "token computed); a capacity factor drops tokens"),
    "--moe-router-topk-scaling-factor": ((None,), "the planner's router weights are the "
                                         "renormalised top-k probabilities, unscaled"),
    "--moe-router-score-function": ((None, "softmax"), "the planner's router is a softmax"),
}  # fmt: skip
# --fp8-recipe -> CostOptions.fp8_scaling (Transformer Engine's per-tensor recipes)
_FP8_RECIPES = {"delayed": "delayed", "tensorwise": "dynamic"}
_LAYER_FREQ = re.compile(r"\(?\[0\]\*(\d+)\+\[1\]\*(\d+)\)?")  # "([0]*3+[1]*58)", as exported
_DEFAULT_DROPOUT = 0.1  # Megatron-LM's --attention-dropout and --hidden-dropout
_FAMILIES = {("RMSNorm", "rope"): Family.LLAMA, ("LayerNorm", "learned_absolute"): Family.GPT}
_OPTIMIZERS = {"adam": Optimizer.ADAMW, "sgd": Optimizer.SGD}  # Megatron's adam is AdamW


def _parse(text: str, source: str) -> Settings:
    """The options after the training script, with a launcher's world-size options."""
    words, launcher = command_words(text, source)
    return Settings(option_values(words, source, _FLAGS, "Megatron-LM") | launcher, source)


def read_megatron(text: str, source: str, detected: str, options: Options) -> ImportedRun:
    """The run ``text`` (Megatron-LM arguments) describes, completed by ``options``."""
    settings = _parse(text, source)
    settings.check_unpriced(_UNPRICED)
    tp, pp, cp = (
        settings.integer(f"--{name}-parallel-size", 1)
        for name in ("tensor-model", "pipeline-model", "context")
    )
    notes: list[str] = []
    described = _model(settings, tp, notes)
    model = choose_model(settings, described, "--num-layers, --hidden-size, ...", options.model)
    cluster = resolve_world(settings, options, *_launched(settings, tp * pp * cp))
    dp = _data_parallel_size(settings, cluster.num_gpus, tp * pp * cp)
    counts, virtual = _pipeline(settings, model.num_layers, pp)
    micro = settings.integer("--micro-batch-size", 1)
    zero, dp_shard = _sharding(settings, dp)
    dtype = _dtype(settings, notes)
    training = {
        "global_batch_size": settings.integer("--global-batch-size", micro * dp),
        "seq_len": settings.integer("--seq-length", model.seq_len), "dtype": dtype.value,
        "optimizer": _optimizer(settings).value,
        "grad_clip": settings.number("--clip-grad", 1.0) > 0,
    }  # fmt: skip
    strategy = {
        "dp": dp, "dp_shard": dp_shard, "tp": tp, "pp": pp, "cp": cp, "zero": zero,
        **_expert_parallel(settings, model, tp),
        "sequence_parallel": _sequence_parallel(settings, tp, notes),
        "micro_batch_size": micro, "virtual_stages": virtual,
        "schedule": (Schedule.INTERLEAVED_1F1B if virtual > 1 else Schedule.ONE_F_ONE_B).value,
        "compression": {"kind": _reduction(settings, dtype).value},
        **_recompute(settings),
    }  # fmt: skip
    return build_run(
        settings, format=FORMAT, detected=detected, model=model, cluster=cluster,
        training=training, strategy=strategy,
        options=_cost_options(settings, dp, zero, notes) | _recompute_modules(settings, strategy)
        | _dispatcher(settings, strategy["ep"], strategy.get("etp", 1)) | _cp_comm(settings, cp),
        stages=chunks_of(model, counts) if pp > 1 else (), notes=notes,
    )  # fmt: skip


def _launched(settings: Settings, model_parallel: int) -> tuple[int | None, str]:
    """The world size a ``torchrun`` command gives, or None and why it is needed."""
    world, how = launched_world(settings)
    if world is None:
        return None, (
            f"Megatron-LM's data-parallel size is what is left of the world (world / (tp x pp x "
            f"cp = {model_parallel})), and no torchrun --nproc_per_node gives the world"
        )
    return world, how


def _data_parallel_size(settings: Settings, world: int, model_parallel: int) -> int:
    if world % model_parallel:
        raise SpecError(
            f"cannot read {settings.source}: tp x pp x cp = {model_parallel} does not divide "
            f"the {world} GPUs; change the parallel sizes or the GPU count"
        )
    return world // model_parallel


def _model(settings: Settings, tp: int, notes: list[str]) -> ModelSpec | None:
    """The network the size arguments describe (None without ``--num-layers``)."""
    if "--num-layers" not in settings:
        return None
    rope = settings.flag("--use-rotary-position-embeddings")
    position = "rope" if rope else settings.text("--position-embedding-type", "learned_absolute")
    norm = settings.text("--normalization", "LayerNorm")
    family = _FAMILIES.get((norm, position))
    if family is None:
        pairs = "; ".join(f"{n} with {p} ({f.value})" for (n, p), f in _FAMILIES.items())
        raise settings.refuse(
            "--position-embedding-type", position,
            f"the planner's transformers pair {pairs}, and --normalization is {norm!r}",
            "price a llama-style (RMSNorm, rope) or gpt-style (LayerNorm, learned) model",
        )  # fmt: skip
    _check_bias(settings, family)
    _check_heads(settings)
    hidden = settings.integer("--hidden-size", 1)
    heads = settings.integer("--num-attention-heads", 1)
    swiglu = settings.flag("--swiglu")
    fields = {
        "family": family.value, "num_layers": settings.integer("--num-layers", 1),
        "hidden_size": hidden, "num_heads": heads,
        "num_kv_heads": settings.integer("--num-query-groups", 1)
        if settings.flag("--group-query-attention") else heads,
        "ffn_hidden_size": settings.integer("--ffn-hidden-size", _ffn_default(hidden, swiglu)),
        "vocab_size": _padded_vocabulary(settings, tp, notes),
        "seq_len": _sequence(settings),
        "activation": (Activation.SWIGLU if swiglu else Activation.GELU).value,
        "tied_embeddings": not settings.flag("--untie-embeddings-and-output-weights"),
        "norm_eps": settings.number("--norm-epsilon", 1e-5),
        "rope_theta": settings.number("--rotary-base", 10000.0),
        **_latent_attention(settings, notes),
        **_experts(settings),
        **_head_width(settings),
    }  # fmt: skip
    if settings.flag("--multi-latent-attention"):
        fields["num_kv_heads"] = heads  # latent attention has no query groups
    spec = load_document(ModelSpec, fields, f"{settings.source} network-size arguments")
    return matching_preset(spec) or spec


def _latent_attention(settings: Settings, notes: list[str]) -> dict[str, Any]:
    """Multi-head latent attention's sizes (Megatron-LM's defaults where absent)."""
    if not settings.flag("--multi-latent-attention"):
        return {}
    rope_type = settings.text("--rope-type", "yarn")  # MLATransformerConfig's default
    if rope_type != "rope":
        notes.append(
            f"--rope-type {rope_type}: priced as plain RoPE (the rotary frequencies do not "
            "change the cost)"
        )
    return {
        "kv_lora_rank": settings.integer("--kv-lora-rank", 32),
        "q_lora_rank": settings.integer("--q-lora-rank", 1)
        if "--q-lora-rank" in settings
        else None,
        "qk_nope_head_dim": settings.integer("--qk-head-dim", 128),
        "qk_rope_head_dim": settings.integer("--qk-pos-emb-head-dim", 64),
        "v_head_dim": settings.integer("--v-head-dim", 128),
    }


def _experts(settings: Settings) -> dict[str, Any]:
    """The MoE fields: routed experts, top-k, expert width, shared experts (Megatron's one
    shared MLP of ``num_shared x width``) and the leading dense layers."""
    if "--num-experts" not in settings:
        return {}
    experts = settings.integer("--num-experts", 1)
    top_k = settings.integer("--moe-router-topk", 2)
    if settings.flag("--moe-router-pre-softmax") and top_k > 1:
        raise settings.refuse(
            "--moe-router-pre-softmax", True,
            "the planner's router weights are the top-k probabilities renormalised (softmax "
            "over the top-k logits), not the softmax over every expert",
            "remove --moe-router-pre-softmax",
        )  # fmt: skip
    width = settings.integer("--moe-ffn-hidden-size", settings.integer("--ffn-hidden-size", 1))
    return {
        "num_experts": experts, "top_k": top_k, "moe_ffn_hidden_size": width,
        "num_shared_experts": _shared_experts(settings, width),
        "dense_layers": _dense_layers(settings),
    }  # fmt: skip


def _shared_experts(settings: Settings, width: int) -> int:
    key = "--moe-shared-expert-intermediate-size"
    size = settings.integer(key, 0, least=0)
    if size % width:
        raise settings.refuse(
            key, settings.get(key),
            f"the planner's shared experts are whole experts of --moe-ffn-hidden-size {width}",
            f"use a multiple of {width}",
        )  # fmt: skip
    return size // width


def _dense_layers(settings: Settings) -> int:
    """Leading dense blocks: ``--moe-layer-freq 1`` (every block) or ``([0]*k+[1]*n)``."""
    value = str(settings.get("--moe-layer-freq", "1")).replace(" ", "")
    if value == "1":
        return 0
    match = _LAYER_FREQ.fullmatch(value)
    if match is None or int(match[1]) + int(match[2]) != settings.integer("--num-layers", 1):
        raise settings.refuse(
            "--moe-layer-freq", value,
            "the planner's MoE models have k dense blocks first, then experts in every block",
            "write it as \"([0]*k+[1]*n)\" with k + n = --num-layers, or 1",
        )  # fmt: skip
    return int(match[1])


def _expert_parallel(settings: Settings, model: ModelSpec, tp: int) -> dict[str, int]:
    """``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size`` (Megatron's
    default: the tensor-parallel size), checked to be what the planner prices: all-to-all
    dispatch, and experts split over tensor-parallel ranks only beside expert
    parallelism."""
    ep = settings.integer("--expert-model-parallel-size", 1)
    if not model.moe:
        return {"ep": ep}
    etp = settings.integer("--expert-tensor-parallel-size", tp)
    if ep == 1 and etp != 1:
        raise settings.refuse(
            "--expert-tensor-parallel-size", settings.get("--expert-tensor-parallel-size", tp),
            "without expert parallelism the planner prices every expert whole on each "
            "tensor-parallel rank (Megatron's default is the tensor-parallel size)",
            "add --expert-tensor-parallel-size 1, or --expert-model-parallel-size > 1",
        )  # fmt: skip
    settings.flag("--moe-grouped-gemm")  # how experts compute, priced alike
    settings.get("--moe-router-load-balancing-type")
    # random router logits: experts drawn evenly, as CostOptions.expert_choice's default
    settings.flag("--moe-router-force-load-balancing")
    return {"ep": ep, "etp": etp}


def _dispatcher(settings: Settings, ep: int, etp: int) -> dict[str, Any]:
    """The cost options of ``--moe-token-dispatcher-type`` beside expert parallelism:
    ``alltoall`` sends every (token, expert) pair; ``flex`` with DeepEP or HybridEP sends
    a token once per rank and node (``ep_dedup``)."""
    dispatcher = settings.text("--moe-token-dispatcher-type", "allgather")
    if ep == 1 or dispatcher == "alltoall":
        return {}
    if dispatcher != "flex":
        raise settings.refuse(
            "--moe-token-dispatcher-type", dispatcher,
            "the planner prices expert parallelism as all-to-all token exchanges "
            "(alltoall, or flex with DeepEP or HybridEP)",
            "use --moe-token-dispatcher-type alltoall",
        )  # fmt: skip
    default = "deepep" if settings.flag("--moe-enable-deepep") else None
    backend = settings.get("--moe-flex-dispatcher-backend", default)
    if backend not in _DEDUPLICATING_BACKENDS:
        raise settings.refuse(
            "--moe-flex-dispatcher-backend", backend,
            f"the planner prices the flex dispatcher with {' or '.join(_DEDUPLICATING_BACKENDS)}",
            "add --moe-flex-dispatcher-backend deepep (or --moe-enable-deepep)",
        )  # fmt: skip
    if etp != 1:
        raise settings.refuse(
            "--expert-tensor-parallel-size", etp,
            "the flex dispatcher folds expert tensor parallelism into its dispatch group, "
            "which the planner does not price",
            "use --expert-tensor-parallel-size 1, or --moe-token-dispatcher-type alltoall",
        )  # fmt: skip
    return {"ep_dedup": True}


def _sequence(settings: Settings) -> int:
    """Tokens per sequence: ``--seq-length``, else ``--max-position-embeddings``."""
    for key in ("--seq-length", "--max-position-embeddings"):
        if key in settings:
            return settings.integer(key, 1)
    raise SpecError(
        f"cannot read {settings.source}: the network-size arguments give no --seq-length; add it"
    )


def _ffn_default(hidden: int, swiglu: bool) -> int:
    """Megatron-LM's ``--ffn-hidden-size`` when absent (2/3 of 4h for SwiGLU, to 64)."""
    return int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden


def _check_bias(settings: Settings, family: Family) -> None:
    biased = not settings.flag("--disable-bias-linear")
    if biased != (family is Family.GPT):
        raise settings.refuse(
            "--disable-bias-linear", not biased,
            f"the planner's {family.value} transformer has "
            f"{'biases' if family is Family.GPT else 'no biases'} in its linear layers",
            "add --disable-bias-linear" if biased else "remove --disable-bias-linear",
        )  # fmt: skip


def _head_width(settings: Settings) -> dict[str, Any]:
    """``head_dim`` when ``--kv-channels`` is not hidden / heads (Qwen3), and ``qk_norm``
    from ``--qk-layernorm``."""
    fields: dict[str, Any] = {"qk_norm": settings.flag("--qk-layernorm")}
    channels = settings.get("--kv-channels")
    per_head = settings.integer("--hidden-size", 1) // settings.integer("--num-attention-heads", 1)
    if channels is not None and settings.integer("--kv-channels", 1) != per_head:
        fields["head_dim"] = settings.integer("--kv-channels", 1)
    return fields


def _check_heads(settings: Settings) -> None:
    percent = settings.number("--rotary-percent", 1.0)
    if percent != 1.0:
        raise settings.refuse(
            "--rotary-percent", percent, "the planner rotates every head dimension",
            "remove --rotary-percent",
        )  # fmt: skip


def _padded_vocabulary(settings: Settings, tp: int, notes: list[str]) -> int:
    """``--vocab-size`` padded to a multiple of ``--make-vocab-size-divisible-by x tp``."""
    if "--vocab-size" not in settings:
        raise SpecError(
            f"cannot read {settings.source}: the network-size arguments give no --vocab-size "
            "(Megatron-LM takes it from the tokenizer); add --vocab-size N, or give --model "
            "instead of the network-size arguments"
        )
    size = settings.integer("--vocab-size", 1)
    divisible_by = settings.integer("--make-vocab-size-divisible-by", MEGATRON_VOCAB_MULTIPLE)
    padded = megatron_padded_vocab(size, divisible_by, tp)
    if padded != size:
        notes.append(
            f"vocabulary {size} padded to {padded} (a multiple of --make-vocab-size-divisible-by "
            f"x tp = {divisible_by * tp}), as Megatron-LM pads it"
        )
    return padded


def _sequence_parallel(settings: Settings, tp: int, notes: list[str]) -> bool:
    if settings.flag("--sequence-parallel") and tp == 1:
        notes.append("--sequence-parallel with tp 1: Megatron-LM turns it off")
        return False
    return settings.flag("--sequence-parallel")


def _pipeline(settings: Settings, layers: int, pp: int) -> tuple[list[int], int]:
    """Blocks per model chunk (pipeline order) and model chunks per pipeline rank."""
    if pp == 1:
        return [layers], 1
    layout = settings.get("--pipeline-model-parallel-layout")
    accounted = _accounted(settings)
    if layout is not None:
        if any(accounted):
            raise _layout_conflict(settings, "--pipeline-model-parallel-layout")
        counts = _layout(settings, str(layout))
    elif "--num-layers-per-virtual-pipeline-stage" in settings:
        per_chunk = settings.integer("--num-layers-per-virtual-pipeline-stage", 1)
        total = layers + sum(accounted)
        counts = _even(
            settings, layers, total // per_chunk if total % per_chunk == 0 else 0, accounted
        )
    elif "--num-virtual-stages-per-pipeline-rank" in settings:
        chunks = pp * settings.integer("--num-virtual-stages-per-pipeline-rank", 1)
        counts = _even(settings, layers, chunks, accounted)
    elif any(accounted):
        for option in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
            if option in settings:
                raise _layout_conflict(settings, option)
        counts = _even(settings, layers, pp, accounted)
    else:
        counts = _first_last(settings, layers, pp)
    if len(counts) % pp or sum(counts) != layers:
        raise SpecError(
            f"cannot read {settings.source}: the pipeline split {counts} does not give each of "
            f"the pp = {pp} ranks as many chunks, or does not hold the {layers} layers; "
            "check the pipeline arguments"
        )
    return counts, len(counts) // pp


def _accounted(settings: Settings) -> tuple[int, int]:
    """Whether the embedding and the loss count as a layer each in the pipeline split
    (``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``)."""
    return (
        int(settings.flag("--account-for-embedding-in-pipeline-split")),
        int(settings.flag("--account-for-loss-in-pipeline-split")),
    )


def _layout_conflict(settings: Settings, option: str) -> SpecError:
    return settings.refuse(
        option, settings.get(option),
        "Megatron-LM refuses it beside --account-for-embedding/loss-in-pipeline-split "
        "(transformer_config.py)",
        "drop one of them",
    )  # fmt: skip


def _even(settings: Settings, layers: int, chunks: int, accounted: tuple[int, int]) -> list[int]:
    """Megatron's even split (transformer_block.py, get_num_layers_to_build): the layers,
    plus the embedding and the loss where the split accounts for them, evenly over the
    chunks; the first chunk then builds one layer fewer for the embedding, the last one
    fewer for the loss."""
    embedding, loss = accounted
    counts = even_split(layers, chunks, embedding=bool(embedding), loss=bool(loss))
    if counts is None:
        total = layers + embedding + loss
        accounting = " (with the embedding and loss the split accounts for)" * (embedding or loss)
        raise SpecError(
            f"cannot read {settings.source}: {total} layers{accounting} do not split evenly "
            f"into the pipeline's chunks ({chunks or 'a fraction'}); check --num-layers, "
            "--pipeline-model-parallel-size, --num-layers-per-virtual-pipeline-stage or "
            "--num-virtual-stages-per-pipeline-rank"
        )
    return counts


def even_split(layers: int, chunks: int, *, embedding: bool, loss: bool) -> list[int] | None:
    """Layers per model chunk (pipeline order) of Megatron's even split, the embedding
    and the loss counted as a layer each where ``embedding``/``loss``; ``None`` when
    they do not divide evenly."""
    total = layers + embedding + loss
    if chunks == 0 or total % chunks or total // chunks < max(embedding, loss):
        return None
    counts = [total // chunks] * chunks
    counts[0] -= embedding
    counts[-1] -= loss
    return counts


def _first_last(settings: Settings, layers: int, pp: int) -> list[int]:
    """One chunk per rank: ``--decoder-first/last-pipeline-num-layers`` on the end
    stages, the rest evenly between them (all even without them)."""
    first = settings.integer("--decoder-first-pipeline-num-layers", 0, least=0) or None
    last = settings.integer("--decoder-last-pipeline-num-layers", 0, least=0) or None
    ends = [count for count in (first, last) if count is not None]
    middle_stages = pp - len(ends)
    rest = layers - sum(ends)
    if middle_stages == 0:
        middle: list[int] = []
    elif rest <= 0 or rest % middle_stages:
        raise SpecError(
            f"cannot read {settings.source}: the {rest} layers left after the first/last "
            f"stages do not split evenly over {middle_stages} pipeline stages; change "
            "--num-layers or the first/last stage layers"
        )
    else:
        middle = [rest // middle_stages] * middle_stages
    return ([first] if first else []) + middle + ([last] if last else [])


def _layout(settings: Settings, layout: str) -> list[int]:
    """Blocks per chunk of a ``--pipeline-model-parallel-layout`` such as ``Ett|tt|ttL``
    (``E`` embedding, ``t`` a layer, ``L`` the loss, ``|`` between chunks, ``x*N`` repeats)."""
    text = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m[1] * int(m[2]), layout.replace(" ", ""))
    text = re.sub(r"([EtL|])\*(\d+)", lambda m: m[1] * int(m[2]), text)
    chunks = text.split("|")
    for index, chunk in enumerate(chunks):
        embedding, loss = chunk.startswith("E"), chunk.endswith("L")
        if (
            not re.fullmatch(r"E?t*L?", chunk)
            or embedding != (index == 0)
            or loss != (index == len(chunks) - 1)
        ):
            raise settings.refuse(
                "--pipeline-model-parallel-layout", layout,
                f"chunk {index} ({chunk!r}) is not E (first chunk only), layers t, L (last only)",
                "write the layout with E, t, L and | only",
            )  # fmt: skip
    return [chunk.count("t") for chunk in chunks]


def _sharding(settings: Settings, dp: int) -> tuple[int, int | None]:
    """ZeRO stage and shard group: the distributed optimizer (ZeRO-1) or Megatron-FSDP
    (its sharding strategy), hybrid over ``--num-distributed-optimizer-instances``."""
    if settings.flag("--use-megatron-fsdp"):
        name = settings.text("--data-parallel-sharding-strategy", "no_shard")
        stages = {strategy: zero for zero, strategy in SHARDING.items()}
        if name not in stages:
            raise settings.refuse(
                "--data-parallel-sharding-strategy", name,
                f"the importer reads Megatron-FSDP's {' and '.join(stages)} (ZeRO-2 and ZeRO-3)",
                "use one of them, or --use-distributed-optimizer without --use-megatron-fsdp "
                "for ZeRO-1",
            )  # fmt: skip
        zero = stages[name]
    elif settings.flag("--use-distributed-optimizer"):
        zero = 1
    else:
        return 0, None
    instances = settings.integer("--num-distributed-optimizer-instances", 1)
    if dp % instances:
        raise settings.refuse(
            "--num-distributed-optimizer-instances", instances,
            f"does not divide the data-parallel size {dp}", "use a divisor of it",
        )  # fmt: skip
    return zero, (dp // instances if instances > 1 else None)


def _recompute(settings: Settings) -> dict[str, Any]:
    granularity = settings.get("--recompute-granularity")
    if granularity is None and settings.flag("--recompute-activations"):
        granularity = "selective"
    if granularity is None:
        return {"recompute": RecomputeMode.NONE.value}
    if granularity == "selective":
        return {"recompute": RecomputeMode.SELECTIVE.value}
    if granularity != "full":
        raise settings.refuse(
            "--recompute-granularity", granularity, "Megatron-LM takes full or selective",
            "use one of them",
        )  # fmt: skip
    method = settings.get("--recompute-method")
    for key in ("--recompute-method", "--recompute-num-layers"):
        if key not in settings:  # TransformerConfig: full granularity needs both
            raise settings.refuse(
                key, None, "Megatron-LM refuses --recompute-granularity full without "
                "--recompute-method (uniform or block) and --recompute-num-layers",
                "add --recompute-method uniform --recompute-num-layers 1 (every layer), or "
                "block with the layers per chunk",
            )  # fmt: skip
    layers = settings.integer("--recompute-num-layers", 1)
    if method == "block":
        return {"recompute": RecomputeMode.FULL.value, "recompute_blocks": layers}
    if method == "uniform" and layers == 1:
        return {"recompute": RecomputeMode.FULL.value}
    raise settings.refuse(
        "--recompute-method", method,
        "the planner prices full recompute of every layer (uniform with --recompute-num-layers "
        f"1) or of the first k layers per chunk (block); here {layers} layers share a checkpoint",
        "use --recompute-method uniform --recompute-num-layers 1, or block",
    )  # fmt: skip


def _recompute_modules(settings: Settings, strategy: dict[str, Any]) -> dict[str, Any]:
    """Selective recompute of ``--recompute-modules`` (Megatron-LM's default: core_attn)."""
    modules = settings.get("--recompute-modules")
    if modules is None or strategy["recompute"] != RecomputeMode.SELECTIVE.value:
        return {}
    names = [modules] if isinstance(modules, str) else list(modules)
    known = [m.value for m in RecomputeModule]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise settings.refuse(
            "--recompute-modules", " ".join(names),
            f"the planner prices recompute of {', '.join(known)}, not {', '.join(unknown)}",
            "recompute those modules, or full layers (--recompute-granularity full)",
        )  # fmt: skip
    return {"selective": SelectivePolicy.MODULES.value, "recompute_modules": names}


def _dtype(settings: Settings, notes: list[str]) -> DType:
    """The training dtype whose Megatron-LM switches (:data:`DTYPE_ARGS`) are given."""
    given: set[tuple[str, ...]] = {(key,) for key in ("--bf16", "--fp16") if settings.flag(key)}
    fp8 = settings.get("--fp8-format")
    if fp8 is not None:
        hybrid = next(
            arg for args in DTYPE_ARGS.values() for arg in args if arg[0] == "--fp8-format"
        )
        if fp8 != hybrid[1]:
            notes.append(f"--fp8-format {fp8} priced as fp8 matmuls, like {hybrid[1]}")
        given.add(hybrid)
    for dtype, args in DTYPE_ARGS.items():
        if set(args) == given:
            return dtype
    shown = " ".join(" ".join(arg) for arg in sorted(given))
    known = "; ".join(f"{d.value}: {' '.join(' '.join(a) for a in args) or '(none)'}"
                      for d, args in DTYPE_ARGS.items())  # fmt: skip
    raise settings.refuse(
        "--bf16/--fp16/--fp8-format", shown, f"the planner prices {known}", "give one of those"
    )


def _reduction(settings: Settings, dtype: DType) -> CompressionKind:
    """The gradient-reduction dtype: fp32, or the 2-byte reduction Megatron-LM offers
    (``--grad-reduce-in-bf16``; under fp16 unless ``--accumulate-allreduce-grads-in-fp32``)."""
    half = MEGATRON_HALF_REDUCTION.get(dtype)
    if settings.flag("--grad-reduce-in-bf16"):
        if half is not CompressionKind.BF16:
            raise settings.refuse(
                "--grad-reduce-in-bf16", True,
                f"Megatron-LM reduces {dtype.value} gradients in fp32"
                + (f" or {half.value}" if half else ""),
                "remove it, or train in bf16",
            )  # fmt: skip
        return half
    fp32 = dtype is not DType.FP16 or settings.flag("--accumulate-allreduce-grads-in-fp32")
    return CompressionKind.NONE if fp32 or half is None else half


def _optimizer(settings: Settings) -> Optimizer:
    name = settings.text("--optimizer", "adam")
    if name not in _OPTIMIZERS:
        raise settings.refuse(
            "--optimizer", name, f"the planner prices {' and '.join(_OPTIMIZERS)}",
            "use one of them",
        )  # fmt: skip
    return _OPTIMIZERS[name]


def _cp_comm(settings: Settings, cp: int) -> dict[str, Any]:
    """``--cp-comm-type`` (one value, or one per layer) as ``CostOptions.cp_attention``:
    Transformer Engine's ring (``p2p``, the default) or all-gathered keys and values
    (``allgather``); the all-to-all kinds (Ulysses' ``a2a``, ``a2a+p2p``) are refused."""
    value = settings.get("--cp-comm-type", "p2p")
    if cp == 1:
        return {}
    kinds = set(value.split()) if isinstance(value, str) else {str(v) for v in value}
    priced = {"p2p": "ring", "allgather": "all-gather"}
    unpriced = sorted(kinds - set(priced))
    if unpriced or len(kinds) > 1:
        raise settings.refuse(
            "--cp-comm-type", value,
            "the planner prices one context-parallel kind for every layer: the K/V ring (p2p) "
            "or all-gathered K/V (allgather), not the all-to-all of heads (a2a, a2a+p2p)",
            "use p2p or allgather to price the run",
        )  # fmt: skip
    return {"cp_attention": priced[kinds.pop()]}


def _cost_options(settings: Settings, dp: int, zero: int, notes: list[str]) -> dict[str, Any]:
    """What Megatron-LM overlaps (only when asked), whether dropout masks are kept, and
    what its kernels keep (:data:`~planner.frameworks.KERNELS`)."""
    options: dict[str, Any] = {
        "overlap_grad_reduce": settings.flag("--overlap-grad-reduce"),
        "overlap_param_gather": settings.flag("--overlap-param-gather"),
        "tp_comm_overlap": settings.flag("--tp-comm-overlap"),
        "fp8_param_gather": settings.flag("--fp8-param-gather"),
        **KERNELS[Framework.MEGATRON],
    }
    if settings.flag("--no-gradient-accumulation-fusion"):
        options["grad_accumulation"] = GradAccumulation.AUTOGRAD.value
    recipe = settings.get("--fp8-recipe")
    if recipe is not None:
        if recipe not in _FP8_RECIPES:
            raise settings.refuse(
                "--fp8-recipe", recipe, "the planner prices per-tensor scaling: "
                + ", ".join(f"{name} ({scaling})" for name, scaling in _FP8_RECIPES.items()),
                "use one of those",
            )  # fmt: skip
        options["fp8_scaling"] = _FP8_RECIPES[recipe]
    if dp > 1 and not options["overlap_grad_reduce"]:
        notes.append("no --overlap-grad-reduce: the gradient reduction is priced after backward")
    if zero and not options["overlap_param_gather"]:
        notes.append("no --overlap-param-gather: the weight gathers are priced exposed")
    dropouts = [
        settings.number(f"--{kind}-dropout", _DEFAULT_DROPOUT) for kind in ("attention", "hidden")
    ]
    options["dropout"] = any(rate > 0 for rate in dropouts)
    if options["dropout"]:
        notes.append(f"dropout {max(dropouts)} (--attention-dropout/--hidden-dropout; Megatron-LM's "
                     f"default is {_DEFAULT_DROPOUT}): its masks are priced")  # fmt: skip
    return options
