"""causalqwen-adapter: causal (Cauchy, one-vs-rest) heads as an adapter on a decoder-only causal LM (Qwen2, Llama, ...)."""

from .configuration_causalqwen import CausalQwenConfig
from .kernels import (
    cpu,  # noqa: F401  registers the causalqwen operators' CPU kernels (built on first use)
    cuda,  # noqa: F401  and their CUDA kernels (Triton's, imported at first use)
)
from .modeling_causalqwen import CausalQwenForCausalLM, CausalQwenModel, CausalQwenPreTrainedModel

__version__ = "0.1.0"

__all__ = ["CausalQwenConfig", "CausalQwenForCausalLM", "CausalQwenModel", "CausalQwenPreTrainedModel"]
