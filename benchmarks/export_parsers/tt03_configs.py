"""torchtitan 0.3 ``config_registry`` functions the checker launches exports under.

torchtitan's own ``llama3_405b`` converts its Linear layers to fp8 (Float8LinearConverter,
built when the function runs) and compiles the model; a bf16 plan exported for 0.3 says to
pick a ``--config`` without that converter, as this registry does (``--module tt03_configs
--config llama3_405b``): torchtitan's 70B config with the 405B model (same vocabulary).
The 8B and 70B configs are torchtitan's own.
"""

from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_8b, llama3_70b

__all__ = ["llama3_8b", "llama3_70b", "llama3_405b"]


def llama3_405b():
    """torchtitan's 70B config around the 405B model, without fp8 converters or compile."""
    config = llama3_70b()
    config.model_spec = model_registry("405B")
    return config
