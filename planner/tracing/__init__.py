"""The trace stage: an ``nn.Module`` on meta tensors -> :class:`~planner.graph.OpGraph`.

- :mod:`planner.tracing.tracer`: :func:`trace` (the entry point), training-loss tracing,
  segment assembly;
- :mod:`planner.tracing.fx`: the torch.fx / torch.export front ends and the repeated-block
  finder by structural hash;
- :mod:`planner.tracing.ops`: per-operator accounting (kind, FLOPs, bytes, saved bytes).

The package is ``tracing`` because ``planner.trace`` is the public function.
"""

from planner.tracing.tracer import *  # noqa: F403  (its __all__: the public names)
from planner.tracing.tracer import __all__ as __all__
