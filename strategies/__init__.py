"""The runtime: applies a plan with stock ``torch.distributed`` (imported only when used).

One module per parallel dimension, each with ``apply(model, mesh, plan)`` that changes
the model in place (DDP returns its wrapper) and logs one line:
:mod:`~strategies.mesh`, :mod:`~strategies.pipeline`, :mod:`~strategies.tensor_parallel`,
:mod:`~strategies.checkpointing`, :mod:`~strategies.fsdp`,
:mod:`~strategies.data_parallel`, :mod:`~strategies.compression`.
:func:`strategies.apply.parallelize` runs them in that order; :mod:`~strategies.runner`
is the training loop of ``plan run``.
"""
