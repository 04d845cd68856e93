"""FSDP2 units: one per block, blocks that share a parameter as one unit, a block tied to
a module outside the blocks left to the root's (strategies.fsdp.shard_units)."""

from __future__ import annotations

from torch import nn

from planner.modules import find_blocks
from strategies.fsdp import shard_units
from tests.user_models import GPT, SharedGPT


def _unit_names(model: nn.Module) -> list[list[str]]:
    blocks = find_blocks(model)
    names = {id(block): name for name, block in blocks}
    return [[names[id(block)] for block in unit] for unit in shard_units(model, blocks)]


def test_independent_blocks_are_a_unit_each() -> None:
    assert _unit_names(GPT(n_layer=3)) == [
        ["transformer.h.0"],
        ["transformer.h.1"],
        ["transformer.h.2"],
    ]


def test_blocks_sharing_a_weight_are_one_unit() -> None:
    assert _unit_names(SharedGPT(n_layer=3)) == [
        ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    ]


def test_a_block_sharing_a_weight_with_a_module_outside_the_blocks_is_left_to_the_root() -> None:
    model = GPT(n_layer=3)
    model.transformer.ln_f.weight = model.transformer.h[1].ln_1.weight
    assert _unit_names(model) == [["transformer.h.0"], ["transformer.h.2"]]
