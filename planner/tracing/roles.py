"""Mixture-of-experts marks for traced operators: which module routes, which computes experts.

A module is **experts** when it holds routed experts as grouped 3-D weights
(:func:`planner.models.moe.is_experts`: the zoo's ``Experts`` and transformers' experts
modules alike). Its siblings name the rest of the layer: ``router`` (the zoo) or
``gate`` (transformers' Mixtral, Qwen3-MoE, DeepSeek-V3, OLMoE) is the **router**;
``shared_experts`` (zoo, DeepSeek) or ``shared_expert`` / ``shared_expert_gate``
(Qwen2-MoE) are the **shared experts**. Every operator traced inside one of these
modules carries its :class:`~planner.graph.OpRole`.
"""

from __future__ import annotations

from torch import nn

from planner.errors import SpecError
from planner.graph import OpRole
from planner.models.moe import is_experts

__all__ = ["MoEFacts", "module_roles", "role_of", "moe_facts"]

_ROUTER_NAMES = frozenset({"router", "gate"})
_SHARED_NAMES = frozenset({"shared_experts", "shared_expert", "shared_expert_gate"})
_TOP_K_FIELDS = ("top_k", "num_experts_per_tok")

# (num_experts, top_k, hidden_size) of a block's MoE layer; zeros for a dense block.
MoEFacts = tuple[int, int, int]


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def module_roles(root: nn.Module) -> dict[str, OpRole]:
    """FQN -> role of every experts, router and shared-experts module under ``root``."""
    roles: dict[str, OpRole] = {}
    for fqn, module in root.named_modules():
        children = dict(module.named_children())
        if not any(is_experts(child) for child in children.values()):
            continue
        for name, child in children.items():
            if is_experts(child):
                roles[_join(fqn, name)] = OpRole.EXPERTS
            elif name in _ROUTER_NAMES:
                roles[_join(fqn, name)] = OpRole.ROUTER
            elif name in _SHARED_NAMES:
                roles[_join(fqn, name)] = OpRole.SHARED_EXPERTS
    return roles


def role_of(fqn: str, roles: dict[str, OpRole]) -> OpRole:
    """The role of an operator traced in module ``fqn``: its innermost marked module's."""
    path = fqn
    while path:
        role = roles.get(path)
        if role is not None:
            return role
        path = path.rpartition(".")[0]
    return OpRole.NONE


def _top_k(layer: nn.Module, fqn: str) -> int:
    """Experts per token of the MoE ``layer`` (the module holding the experts)."""
    candidates = [layer, *layer.children()]
    for module in candidates:
        for name in _TOP_K_FIELDS:
            value = getattr(module, name, None)
            if isinstance(value, int) and value > 0:
                return value
    config = getattr(layer, "config", None)
    value = getattr(config, "num_experts_per_tok", None)
    if isinstance(value, int) and value > 0:
        return value
    raise SpecError(
        f"MoE layer {fqn or '<root>'} ({type(layer).__name__}) says no top_k: set a positive "
        "'top_k' (or 'num_experts_per_tok') attribute on it or on its router"
    )


def moe_facts(block: nn.Module, fqn: str = "") -> MoEFacts:
    """(num_experts, top_k, hidden_size) of the first MoE layer in ``block``; zeros if none."""
    for path, module in block.named_modules():
        for child in module.children():
            if is_experts(child):
                experts, _, hidden = child.gate_up_proj.shape
                return int(experts), _top_k(module, _join(fqn, path)), int(hidden)
    return 0, 0, 0
