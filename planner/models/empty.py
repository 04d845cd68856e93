"""Building a model whose parameters hold no memory but whose buffers hold their values.

Under ``torch.device("meta")`` a buffer a module computes in ``__init__`` (a rotary
table, a causal mask) is empty too, and nothing can compute it again after the plan
shards the model unless the module says how. :func:`parameters_on_meta` keeps what
``__init__`` computes: each parameter moves to the meta device as it is registered
(before ``reset_parameters`` draws its values: no time, no memory), every buffer stays
where it was built. Accelerate's ``init_empty_weights()`` builds the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["parameters_on_meta"]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, a module's parameters are put on the meta device as they are
    registered; buffers and other tensors are built where the code builds them."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
