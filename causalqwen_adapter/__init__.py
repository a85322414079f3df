"""causalqwen-adapter: causal (Cauchy, one-vs-rest) heads as an adapter on any Qwen2 checkpoint."""

from .configuration_causalqwen import CausalQwenConfig
from .modeling_causalqwen import CausalQwenForCausalLM, CausalQwenModel, CausalQwenPreTrainedModel

__version__ = "0.1.0"

__all__ = ["CausalQwenConfig", "CausalQwenForCausalLM", "CausalQwenModel", "CausalQwenPreTrainedModel"]
