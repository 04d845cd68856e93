"""What one optimizer step does per element, by implementation (``CostOptions.optimizer_impl``).

torch's for-loop and foreach updates run one operator after another
(``torch.optim.adam._single_tensor_adam``, ``_multi_tensor_adam``); a fused kernel
(``fused=True``, Apex's and Transformer Engine's FusedAdam) reads each state once and
writes the weights and moments back. The counts are per element of the states the step
updates on a rank.
"""

from __future__ import annotations

from planner.cost.options import OptimizerImpl
from planner.spec import Optimizer

__all__ = ["step_passes", "step_temporary_elements"]


def step_passes(impl: OptimizerImpl, optimizer: Optimizer) -> tuple[float, float, float]:
    """Passes (reads plus writes) of one element the update makes over the kept weights,
    over the moments (all of them together; their temporaries counted in the same dtype)
    and over the gradient.

    A fused kernel reads each once and writes weights and moments back. torch's
    for-loop and foreach updates: Adam's ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``,
    ``div``, ``add_`` and ``addcdiv_`` pass 3 and 5 times over its two moments, 6 times
    over temporaries of one moment's size (7 passes of both) and twice over the
    gradient; SGD's ``mul_``, ``add_`` and ``add_`` 5 times over its momentum, once over
    the gradient. Both write the weights once after reading them.
    """
    if impl is OptimizerImpl.FUSED:
        return 2.0, 2.0, 1.0
    if optimizer is Optimizer.SGD:
        return 2.0, 5.0, 1.0
    return 2.0, 7.0, 2.0


def step_temporary_elements(
    impl: OptimizerImpl, optimizer: Optimizer, updated: float, largest: float
) -> float:
    """Elements of a moment's dtype the step allocates beside the states at its peak, for
    ``updated`` elements on the rank whose largest tensor has ``largest``.

    Adam's denominator ``sqrt(v) / bias_correction + eps``: the foreach update makes it
    for every tensor at once (``_foreach_sqrt``), the for-loop one tensor at a time, the
    square root and the quotient alive together; a fused kernel keeps it in registers.
    SGD updates its momentum and the weights in place. (Measured on this CPU with the
    tensor counter of ``plan measure``: 1.0x the parameters foreach, 2.0x the largest
    tensor for-loop, none fused.)
    """
    if impl is OptimizerImpl.FUSED or optimizer is Optimizer.SGD:
        return 0.0
    if impl is OptimizerImpl.FOREACH:
        return updated
    return 2 * largest
