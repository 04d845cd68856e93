"""Facts about a mesh that several layers need, each stated once.

The search's candidate filter, the compression options it offers and validation ask
these functions rather than restating them.
"""

from __future__ import annotations

__all__ = ["ddp_blocker"]


def ddp_blocker(*, dp: int, cp: int, tp: int, pp: int, tied: bool) -> str | None:
    """Why plain data parallelism (ZeRO-0, DDP) cannot replicate over ``dp x cp`` here,
    or ``None`` when it can. DDP's reducer cannot run the several backwards a pipeline
    schedule runs per step (torch 2.13), and DDP over tensor-parallel shards loses tied
    weights; ZeRO >= 1 (FSDP2) replicates the same gradients in both cases."""
    if dp * cp == 1:
        return None
    if pp > 1:
        return f"pp({pp}) > 1: DDP cannot run under a pipeline schedule"
    if tp > 1 and tied:
        return (
            f"tp({tp}) > 1 with tied weights: DDP cannot run over tensor-parallel shards "
            "(it loses the tie)"
        )
    return None
