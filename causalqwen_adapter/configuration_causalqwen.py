"""CausalQwen configuration: the base's config as a sub-config plus the causal-head fields.

Also the checks every entry point runs on the numbers and choices a caller hands over (`check_number`,
`check_choice`), so that a setting is refused the same way wherever it enters: as a config field, a trainer
argument, a recipe flag or a per-call option.

Shipped as remote code: imports only the standard library, torch and transformers.
"""

import math
import numbers
import re
import warnings

import transformers

# The transformers releases this code runs on, checked first: on 4.x it would fail on a missing name
# (PreTrainedConfig) that says nothing about versions; releases after the range are untested.
TRANSFORMERS_SUPPORTED = ">=5.20,<5.25"
_FIRST_SUPPORTED, _FIRST_UNTESTED = (5, 20), (5, 25)


def _release(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else (0, 0)


if _release(transformers.__version__) < _FIRST_SUPPORTED:
    raise ImportError(f"CausalQwen's modeling code needs transformers{TRANSFORMERS_SUPPORTED}, and "
                      f"transformers {transformers.__version__} is installed: pip install "
                      f"'transformers{TRANSFORMERS_SUPPORTED}'")
if _release(transformers.__version__) >= _FIRST_UNTESTED:
    warnings.warn(f"CausalQwen's modeling code is tested on transformers{TRANSFORMERS_SUPPORTED}; "
                  f"transformers {transformers.__version__} is installed and may not work with it", stacklevel=2)

import torch  # noqa: E402
from transformers import AutoConfig, PreTrainedConfig  # noqa: E402
from transformers.configuration_utils import SubConfigSpec  # noqa: E402
from transformers.utils import logging  # noqa: E402

from .cauchy import INFERENCE_MODES  # noqa: E402

ACTION_WEIGHTS = ("full", "tied", "lora")
OBJECTIVES = ("ovr", "softmax")
OVR_DISTRIBUTIONS = ("accept", "accept_once", "normalize")
CONFIG_CHOICES = {"action_weight": ACTION_WEIGHTS, "objective": OBJECTIVES, "ovr_distribution": OVR_DISTRIBUTIONS,
                  "inference_mode": INFERENCE_MODES}
# Qwen2's embedding has 151936 rows; the tokenizer uses the first 151665, the last 271 are reserved.
QWEN2_VOCAB_SIZE = 151936
QWEN2_RESERVED_ROWS = 271
# The absolute threshold where the demo base's standard-mode argmax agrees best with its own (BENCHMARKS.md).
ABSOLUTE_THRESHOLD_INIT = 16.0
# The initial scale of U (gamma_init) for each OvR loss: over candidates P_k is graded from the first step; over the
# whole vocabulary the V − 1 negatives hold the scale near 0 anyway (docs/design.md, Training losses).
CANDIDATES_GAMMA_INIT = 0.005
VOCABULARY_LOSS_GAMMA_INIT = 1e-5
# The initial exogenous noise (b_noise_init), likewise: over candidates at U's own scale, so that `standard` (U's scale
# + the noise), `causal` (U's alone) and `sampling` (U shifted by the noise) differ; over the vocabulary next to
# nothing, as that loss's scale is.
CANDIDATES_B_NOISE_INIT = 0.01
VOCABULARY_LOSS_B_NOISE_INIT = 1e-6
# The numbers of the config: each must be finite in float32, the widest dtype the heads compute in (bfloat16 has the
# same range), and at least its minimum where one is given (the bounds of `check_number`).
AT_LEAST_0 = {"minimum": 0}
NUMBER_FIELDS = {"gamma_init": {"minimum": 0, "strict": True}, "b_noise_init": {}, "ovr_threshold_init": {},
                 "causal_temperature": AT_LEAST_0, "softmax_loss_weight": AT_LEAST_0, "numeric_loss_weight": AT_LEAST_0,
                 "distill_tail_weight": AT_LEAST_0}
INTEGER_FIELDS = ("causal_size", "action_lora_rank")

logger = logging.get_logger(__name__)


def check_number(name: str, value, *, minimum=None, strict: bool = False, integer: bool = False,
                 dtype: torch.dtype | None = torch.float32):
    """`value` as a plain int or float, or a ValueError naming `name`, the value and what is expected.

    Expected: a real number (not a string, a bool or a list; an integer with `integer`), finite, and at least
    `minimum` (above it with `strict`). NaN passes every `< 0` check, so finiteness is checked first. With `dtype`,
    it must also lie within the range of the dtype it is computed in: 1e39 is a finite float64 but inf in float32
    and bfloat16, and would reach the scores as inf or NaN.
    """
    bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum}"
    if integer:
        expected = "a positive integer" if minimum == 1 and not strict else f"an integer{bound}"
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    else:
        expected = f"a finite number{bound}"
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    value = int(value) if integer else float(value)
    if not math.isfinite(value) or (minimum is not None and (value <= minimum if strict else value < minimum)):
        raise ValueError(f"{name} must be {expected}, got {value}")
    # no tensor built: this runs at every decoding step, and configs are built under the meta device too
    if dtype is not None and not integer and dtype.is_floating_point and abs(value) > torch.finfo(dtype).max:
        raise ValueError(f"{name} must be {expected} in {str(dtype).removeprefix('torch.')} (the dtype it is computed "
                         f"in, whose largest value is {torch.finfo(dtype).max:.4g}), got {value:g}")
    return value


def check_choice(name: str, value, choices) -> str:
    """`value` if it is one of `choices`, else a ValueError naming `name`, the value and the allowed ones."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(choices)}")
    return value


class CausalQwenConfig(PreTrainedConfig):
    r"""
    Configuration of a CausalQwen adapter: causal heads (abduction, action, OvR) on a decoder-only causal LM base.

    Args:
        base_model_name_or_path (`str`): Hub id or local folder of the base the heads attach to.
        base_model_revision (`str`, *optional*): revision of the base (branch, tag or commit).
        text_config (`PreTrainedConfig` or `dict`): the base's config, of its own type (`Qwen2Config`,
            `LlamaConfig`, ...; a dict without `model_type` is read as Qwen2's); `get_text_config()` returns it so that
            generation sees the decoder layout.
        causal_size (`int`, *optional*): size C of the individual U; defaults to the base hidden size H.
        gamma_init (`float`, *optional*): initial scale of U, softplus(b_scale) = gamma_init. Unset: 0.005 with the
            OvR loss over candidates (`ovr_candidates`), where P_k is graded from the first step and the scale
            learns; 1e-5 with the loss over the whole vocabulary, whose V − 1 negatives would pull a larger scale down
            anyway (with a scale of order 1 every P_k is near ½ and Σ_k P_k is half the vocabulary).
        b_noise_init (`float`, *optional*): initial value of every component of b_noise, the exogenous noise that
            `standard` adds to U's scale and `sampling` to its location (`causal` leaves it out). Unset: 0.01 with
            the OvR loss over candidates, at the scale U learns there, so that the three modes differ; 1e-6 with the
            loss over the whole vocabulary, whose scale stays near 0.
        ovr_threshold_init (`float`, *optional*): initial OvR threshold C_k. Unset: log ½ with relative thresholds
            (a token is accepted when the compatible model gives it more than half the probability), 16 with absolute
            ones (where the demo base's standard-mode argmax agrees best with its own; the trainers calibrate it on
            the training data for fresh heads).
        ovr_relative_threshold (`bool`): compare C_k with the location's log-probability loc_S_k − logsumexp_j loc_S_j
            (the threshold moves with each position's log-partition, so P_k > ½ exactly when softmax(loc_S)_k > e^C_k
            and at most e^−C tokens per position are above a uniform threshold) instead of with loc_S_k itself, whose
            per-position offset is arbitrary. Adapters saved before this option existed load with False.
        learnable_threshold (`bool`): learn one threshold per vocabulary entry (saved in the adapter).
        inference_mode (`str`): default scoring mode, one of "compatible", "standard", "sampling", "causal".
        causal_temperature (`float`): default temperature T ≥ 0 of the noise in the inference modes.
        action_weight (`str`): where W_A lives — "full" (its own trained and saved matrix), "tied" (the base's
            output embedding itself, frozen, not saved) or "lora" (the base's plus a trained low-rank B·A).
        action_lora_rank (`int`): the rank r of B·A when action_weight="lora".
        numeric (`bool`): the numeric-aware extension (docs/design.md, Numbers): numbers enter as `<NUM>` tokens with a value
            (`numeric_values`), and a Cauchy regression head predicts the value of each `<NUM>`.
        num_token_id (`int`, *optional*): the id of `<NUM>`, a reserved (unused) row of the base vocabulary;
            defaults to V − 271 (151665) for the 151936-row vocabulary of a Qwen2 base, required otherwise.
        numeric_loss_weight (`float`): λ, the weight of the Cauchy NLL of `<NUM>` values beside the OvR loss.
        objective (`str`): the training loss `forward(labels=...)` computes: "ovr" (the one-vs-rest loss of
            docs/design.md, Training losses) or "softmax" (the cross-entropy of softmax(loc_S), the baseline every OvR figure is
            compared with).
        softmax_loss_weight (`float`): with objective="ovr", the weight of an auxiliary softmax cross-entropy on
            loc_S added to the OvR loss (0 = the OvR loss alone, as the seeds had it).
        ovr_trains_location (`bool`): whether the OvR loss's gradient reaches the location path (W_loc, b_loc, W_A,
            b_A). False (measured best for top-1): the locations, which rank the tokens, learn from the softmax term
            only, and the OvR loss trains the scale path and the thresholds. True: the seeds' single loss.
        ovr_distribution (`str`): the next-token distribution q of the OvR modes, whose log the model returns as
            `logits` (what greedy decoding maximises, sampling draws from and the evaluation's NLL scores).
            "accept_once" (measured best): the compatible model proposes a token, the OvR heads accept it with
            probability P_k, and a rejected proposal is replaced by a fresh draw from softmax(loc_S):
            q_k = softmax(loc_S)_k (1 − A + P_k), A = Σ_j softmax_j P_j, never below (1 − A) × the compatible
            model's q_k; "accept": proposals repeat until one is accepted (rejection sampling), q_k ∝ softmax(loc_S)_k
            · P_k, which lets a rejection cost many nats; "normalize": q_k = P_k / Σ_j P_j, the seeds' reading,
            whose polynomial Cauchy tail costs about 2 nats of NLL (docs/design.md, OvR probabilities).
        ovr_candidates (`int`, *optional*): with objective="ovr", the tokens whose binary cross-entropy the OvR loss
            sums at each position: the `ovr_candidates` tokens of largest loc_S (the compatible model's top-K) and the
            target (default 16). None: every token of the vocabulary, the seeds' loss, whose V − 1 negatives hold the
            scales near 0, so that P_k is a step function of the location (docs/design.md, Training losses).
            Adapters saved before this option existed load with None.
        distill_tail_weight (`float`): in offline distillation, the weight of the tail term Σ_{k∉K} −log(1 − P_k)
            beside the top-K MSE (0 = the top-K MSE alone, which leaves the other tokens' P_k free). 1 keeps Σ_k P_k
            near 1 but not the teacher's top-K probabilities; 0 fits those with Σ_k P_k in the hundreds; the weights
            measured between end near 1's fit (0.1 and 0.01 where 1 does, 0.001 at Σ_k P_k ≈ 12; BENCHMARKS.md,
            Offline distillation).
    """

    model_type = "causalqwen"
    # Any base's config, resolved by its model_type; adapters saved when Qwen2 was the only base read as before.
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="qwen2")}
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the KV cache (transformers < / ≥ 5.24)

    base_model_name_or_path: str | None = None
    base_model_revision: str | None = None
    text_config: dict | PreTrainedConfig | None = None
    causal_size: int | None = None
    gamma_init: float | None = None
    b_noise_init: float | None = None
    ovr_threshold_init: float | None = None
    ovr_relative_threshold: bool = True
    learnable_threshold: bool = False
    inference_mode: str = "standard"
    causal_temperature: float = 1.0
    action_weight: str = "full"
    action_lora_rank: int = 16
    numeric: bool = False
    num_token_id: int | None = None
    numeric_loss_weight: float = 1.0
    objective: str = "ovr"
    softmax_loss_weight: float = 1.0
    ovr_trains_location: bool = False
    ovr_distribution: str = "accept_once"
    ovr_candidates: int | None = 16
    distill_tail_weight: float = 1.0

    def __post_init__(self, **kwargs):
        # The base's attention implementation survives wrapping: the parent resets it on sub-configs.
        base_attn = getattr(self.text_config, "_attn_implementation", None)
        super().__post_init__(**kwargs)
        if self._attn_implementation is None and base_attn is not None:
            self._attn_implementation = base_attn
        if self.causal_size is None:
            self.causal_size = self.text_config.hidden_size
        for name, choices in CONFIG_CHOICES.items():
            check_choice(name, getattr(self, name), choices)
        vocabulary_loss = self.ovr_candidates is None
        if self.gamma_init is None:
            self.gamma_init = VOCABULARY_LOSS_GAMMA_INIT if vocabulary_loss else CANDIDATES_GAMMA_INIT
        if self.b_noise_init is None:
            self.b_noise_init = VOCABULARY_LOSS_B_NOISE_INIT if vocabulary_loss else CANDIDATES_B_NOISE_INIT
        if self.ovr_threshold_init is None:
            self.ovr_threshold_init = math.log(0.5) if self.ovr_relative_threshold else ABSOLUTE_THRESHOLD_INIT
        for name, bounds in NUMBER_FIELDS.items():
            setattr(self, name, check_number(name, getattr(self, name), **bounds))
        for name in INTEGER_FIELDS:
            check_number(name, getattr(self, name), minimum=1, integer=True)
        if self.ovr_candidates is not None:
            check_number("ovr_candidates", self.ovr_candidates, minimum=1, integer=True)
            if self.ovr_candidates >= self.vocab_size:
                raise ValueError(f"ovr_candidates={self.ovr_candidates} must be below the vocabulary size "
                                 f"{self.vocab_size}: pass fewer, or ovr_candidates=None to sum the OvR loss over every token")
        if self.action_weight != "full" and self.causal_size != self.text_config.hidden_size:
            raise ValueError(
                f"action_weight={self.action_weight!r} reuses the base's [vocab × hidden] output weights, so "
                f"causal_size must equal the hidden size {self.text_config.hidden_size} (got {self.causal_size})"
            )
        if self.numeric:
            vocab = self.text_config.vocab_size
            # Only Qwen2's vocabulary is known to keep unused rows (Qwen3's has the same size but uses them).
            is_qwen2 = self.text_config.model_type == "qwen2"
            if self.num_token_id is None and is_qwen2 and vocab == QWEN2_VOCAB_SIZE:
                self.num_token_id = QWEN2_VOCAB_SIZE - QWEN2_RESERVED_ROWS  # the first reserved row, 151665
            if self.num_token_id is None:
                raise ValueError(
                    f"numeric=True needs num_token_id on this {self.text_config.model_type!r} base: no row of its "
                    f"{vocab}-token vocabulary is known to be unused (the default V − 271 applies to the 151936-row "
                    "Qwen2 vocabulary only). Pass num_token_id=<the id of a row the tokenizer never produces, e.g. a "
                    "reserved special token>; if the vocabulary has none, add a token to the tokenizer and resize the "
                    "base's embeddings yourself (resize_token_embeddings) and save it before attaching heads: the "
                    "heads never change the base"
                )
            check_number("num_token_id", self.num_token_id, minimum=0, integer=True)
            if not 0 <= self.num_token_id < vocab:
                raise ValueError(f"num_token_id={self.num_token_id} is outside the vocabulary [0, {vocab})")

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        # A saved config without the field is an adapter whose thresholds were trained against loc_S itself.
        if "ovr_relative_threshold" not in config_dict and "ovr_relative_threshold" not in kwargs:
            config_dict = {**config_dict, "ovr_relative_threshold": False}
        # ... and one without ovr_candidates, an adapter trained with the OvR loss over the whole vocabulary.
        if "ovr_candidates" not in config_dict and "ovr_candidates" not in kwargs:
            config_dict = {**config_dict, "ovr_candidates": None}
        if kwargs:
            return super().from_dict(config_dict, **kwargs)
        # What the parent does without kwargs, its info line formatted only when shown: the parent builds the whole
        # config's JSON for it at every load (3 ms of an adapter's load), whatever the log level.
        config = cls(**config_dict)
        logger.info("Model config %s", config)
        return config

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size


__all__ = ["CausalQwenConfig", "check_choice", "check_number"]
