"""CausalQwen configuration: the base Qwen2 config as a sub-config plus the causal-head fields.

Shipped as remote code: imports only transformers.
"""

from transformers import PreTrainedConfig, Qwen2Config

from .cauchy import INFERENCE_MODES

ACTION_WEIGHTS = ("full", "tied", "lora")


class CausalQwenConfig(PreTrainedConfig):
    r"""
    Configuration of a CausalQwen adapter: causal heads (abduction, action, OvR) on a Qwen2 base.

    Args:
        base_model_name_or_path (`str`): Hub id or local folder of the Qwen2 base the heads attach to.
        base_model_revision (`str`, *optional*): revision of the base (branch, tag or commit).
        text_config (`Qwen2Config` or `dict`): the base's config; `get_text_config()` returns it so that
            generation sees the decoder layout.
        causal_size (`int`, *optional*): size C of the individual U; defaults to the base hidden size H.
        gamma_init (`float`): initial scale of U, softplus(b_scale) = gamma_init.
        b_noise_init (`float`): initial value of every component of b_noise.
        ovr_threshold_init (`float`): initial OvR threshold C_k.
        learnable_threshold (`bool`): learn one threshold per vocabulary entry (saved in the adapter).
        inference_mode (`str`): default scoring mode, one of "compatible", "standard", "sampling", "causal".
        causal_temperature (`float`): default temperature T ≥ 0 of the noise in the inference modes.
        action_weight (`str`): where W_A lives — "full" (its own trained and saved matrix), "tied" (the base's
            output embedding itself, frozen, not saved) or "lora" (the base's plus a trained low-rank B·A).
        action_lora_rank (`int`): the rank r of B·A when action_weight="lora".
    """

    model_type = "causalqwen"
    sub_configs_defaults = {"text_config": Qwen2Config}
    keys_to_ignore_at_inference = ["past_key_values"]

    base_model_name_or_path: str | None = None
    base_model_revision: str | None = None
    text_config: dict | PreTrainedConfig | None = None
    causal_size: int | None = None
    gamma_init: float = 10.0
    b_noise_init: float = 0.1
    ovr_threshold_init: float = 0.0
    learnable_threshold: bool = False
    inference_mode: str = "standard"
    causal_temperature: float = 1.0
    action_weight: str = "full"
    action_lora_rank: int = 16

    def __post_init__(self, **kwargs):
        # The base's attention implementation survives wrapping: the parent resets it on sub-configs.
        base_attn = getattr(self.text_config, "_attn_implementation", None)
        super().__post_init__(**kwargs)
        if self._attn_implementation is None and base_attn is not None:
            self._attn_implementation = base_attn
        if self.causal_size is None:
            self.causal_size = self.text_config.hidden_size
        if self.inference_mode not in INFERENCE_MODES:
            raise ValueError(
                f"inference_mode={self.inference_mode!r} is not a mode: choose one of {', '.join(INFERENCE_MODES)}"
            )
        if not self.gamma_init > 0:
            raise ValueError(f"gamma_init must be > 0 (it is the initial Cauchy scale of U), got {self.gamma_init}")
        if self.causal_temperature < 0:
            raise ValueError(f"causal_temperature must be >= 0, got {self.causal_temperature}")
        if self.causal_size < 1:
            raise ValueError(f"causal_size must be a positive integer, got {self.causal_size}")
        if self.action_weight not in ACTION_WEIGHTS:
            raise ValueError(f"action_weight={self.action_weight!r}: choose one of {', '.join(ACTION_WEIGHTS)}")
        if self.action_weight != "full" and self.causal_size != self.text_config.hidden_size:
            raise ValueError(
                f"action_weight={self.action_weight!r} reuses the base's [vocab × hidden] output weights, so "
                f"causal_size must equal the hidden size {self.text_config.hidden_size} (got {self.causal_size})"
            )
        if self.action_lora_rank < 1:
            raise ValueError(f"action_lora_rank must be a positive integer, got {self.action_lora_rank}")

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size


__all__ = ["CausalQwenConfig"]
