"""The runtime: applies a plan with stock ``torch.distributed`` (imported only when used)."""
