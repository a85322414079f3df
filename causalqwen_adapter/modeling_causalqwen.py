"""CausalQwen: causal heads (abduction → action → OvR) on the frozen backbone of a decoder-only LM (docs/design.md).

Read top to bottom: the outputs, then the model (the heads' scores per inference mode, `forward` with its losses).
The head modules are in `heads.py`; building, saving and loading the adapter in `adapter_io.py`
(`CausalAdapterMixin`); the generation hooks in `generation.py`. The heads are an adapter: `save_pretrained`
writes only their tensors plus this file and the files it imports, and `from_pretrained` loads the base named in
the config, then the heads.

Shipped as remote code: imports only the standard library, torch, transformers, safetensors and
huggingface_hub (a transformers dependency).
"""

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import ModelOutput
from transformers.utils import logging

from .adapter_io import CausalAdapterMixin, base_is_tied, read_output_layer
from .cauchy import (
    INFERENCE_MODES,
    ovr_decision_scores,
    ovr_log_prob,
    ovr_probs,
    sample_standard_cauchy,
)
from .configuration_causalqwen import OVR_DISTRIBUTIONS, CausalQwenConfig, check_choice, check_number
from .dispatch import run_operator
from .generation import CausalGenerationMixin
from .heads import (
    AbductionNetwork,
    ActionNetwork,
    NumericHead,
    OvRClassifier,
    check_causal_noise,
    check_numeric_values,
    fused_decode_applies,
)
from .lm_loss import training_loss
from .losses import DecisionHead, log_partition, topk_mse_loss

logger = logging.get_logger(__name__)

NOISE_SHARING = ("step", "sequence")


# --------------------------------------------------------------------------------------- outputs

# The KV cache's name in model outputs and in the backbone's forward: transformers 5.24 renamed `past_key_values` to
# `cache` (its ModelOutput keeps `past_key_values` as a deprecated alias). Remote code runs on the user's version.
CACHE_NAME = "cache" if hasattr(ModelOutput, "past_key_values") else "past_key_values"


@dataclass
class CausalQwenModelOutput(ModelOutput):
    """Cauchy parameters of the individual U and of the decision scores S at the kept positions.

    `scale_S` is None in `compatible` mode (its score is loc_S alone), and so is `scale_U` except in numeric models;
    `causal_noise` is the ε the `sampling` mode drew; `loc_Y`, `scale_Y` are the Cauchy law of the next `<NUM>` value
    (numeric models).
    """

    loc_U: torch.FloatTensor | None = None
    scale_U: torch.FloatTensor | None = None
    loc_S: torch.FloatTensor | None = None
    scale_S: torch.FloatTensor | None = None
    causal_noise: torch.FloatTensor | None = None
    loc_Y: torch.FloatTensor | None = None
    scale_Y: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    __annotations__[CACHE_NAME] = object | None  # noqa: F821 (the class body's own annotations)
    locals()[CACHE_NAME] = None
    hidden_states: tuple | None = None
    attentions: tuple | None = None


@dataclass
class _LossOutput(ModelOutput):
    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    metrics: dict | None = None


@dataclass
class CausalQwenCausalLMOutput(CausalQwenModelOutput, _LossOutput):
    """`logits` are loc_S in `compatible` mode and, in the OvR modes, the log of the config's `ovr_distribution`
    (loc_S + log P_k, or log P_k; P_k itself is `model.ovr_log_probs(loc_S, scale_S)`); `loc_Y`, `scale_Y` the law of
    the next `<NUM>` value (numeric models). With labels: `loss`, and `metrics`, a detached [sum, count] tensor per
    name (`target_prob`, `ovr_prob_sum`, `units_mean_loc`, `units_mean_scale`, `softmax_nll`, `numeric_nll`).

    The fields are `loss`, `logits`, `metrics`, then those of `CausalQwenModelOutput` (`last_hidden_state` stays
    None: the heads have read it)."""


# --------------------------------------------------------------------------------------- model


class CausalQwenPreTrainedModel(PreTrainedModel):
    config_class = CausalQwenConfig
    config: CausalQwenConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = None  # the backbone's own (its decoder layer), gathered by post_init from the child
    _skip_keys_device_placement = [CACHE_NAME]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        if isinstance(module, AbductionNetwork):
            module.reset_parameters(self.config.gamma_init)
        elif isinstance(module, ActionNetwork):
            module.reset_parameters(self.config.b_noise_init)
        elif isinstance(module, OvRClassifier):
            module.reset_parameters()
        elif isinstance(module, NumericHead):
            module.reset_parameters()
        else:
            super()._init_weights(module)


class CausalQwenModel(CausalAdapterMixin, CausalQwenPreTrainedModel):
    """The base's backbone + causal heads; returns the Cauchy parameters of U and S (what `AutoModel` loads)."""

    def __init__(self, config: CausalQwenConfig, backbone: nn.Module | None = None, lm_head: nn.Linear | None = None):
        super().__init__(config)
        text = config.text_config
        for loaded in (backbone, lm_head):
            # Already-loaded base modules: mark them so post_init's weight initialisation leaves them alone.
            for module in loaded.modules() if loaded is not None else ():
                module._is_hf_initialized = True
        self.model = backbone if backbone is not None else AutoModel.from_config(text)
        self.model.requires_grad_(False)  # frozen by default: the heads are what trains
        for name, head in self.build_heads(config).items():
            setattr(self, name, head)
        if config.action_weight != "full":
            # W_base is the base's output embedding: the input embedding when tied, else its lm_head (frozen, not saved).
            if base_is_tied(text):
                owner = self.model.get_input_embeddings()
            else:
                self.lm_head = lm_head if lm_head is not None else nn.Linear(text.hidden_size, text.vocab_size, bias=False)
                self.lm_head.requires_grad_(False)
                owner = self.lm_head
            self.action.bind_base_weight(owner)
        self.post_init()

    @staticmethod
    def build_heads(config: CausalQwenConfig) -> dict[str, nn.Module]:
        """The head modules `config` describes, by attribute name (what an adapter file holds, `adapter_keys`)."""
        text = config.text_config
        heads = {
            "abduction": AbductionNetwork(text.hidden_size, config.causal_size),
            "action": ActionNetwork(config.causal_size, text.vocab_size, config.action_weight, config.action_lora_rank),
            "ovr": OvRClassifier(text.vocab_size, config.ovr_threshold_init, config.learnable_threshold,
                                 config.ovr_relative_threshold),
        }
        if config.numeric:
            heads["numeric"] = NumericHead(text.hidden_size, config.causal_size)
        return heads

    @classmethod
    def adapter_tensor_shapes(cls, config: CausalQwenConfig) -> dict[str, tuple[int, ...]]:
        """Name → shape of every tensor an adapter file of `config` holds, from heads built on the meta device alone
        (no backbone: nothing allocated, and no sharded-initialisation hook of the base's class runs)."""
        with torch.device("meta"):
            heads = cls.build_heads(config)
        return {f"{name}.{key}": tuple(tensor.shape) for name, head in heads.items()
                for key, tensor in head.state_dict(keep_vars=True).items()}

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    # ------------------------------------------------------------------ forward

    def _run_backbone(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs,
                      numeric_values=None):
        kwargs = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
        cache = kwargs.pop("cache", None)  # generate() of transformers ≥ 5.24 passes the KV cache by that name
        input_ids, inputs_embeds = self.embed_numbers(input_ids, inputs_embeds, numeric_values)
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **{CACHE_NAME: cache if past_key_values is None else past_key_values},
            **kwargs,
        )

    def embed_numbers(self, input_ids, inputs_embeds, numeric_values):
        """(input_ids, inputs_embeds) for the backbone: with `numeric_values`, e = embed(token) + φ(v)·d.

        A value counts at a `<NUM>` token only, and must be 0 at every other token (docs/design.md, Numbers): the
        tokens say where the numbers are, so values need `input_ids`."""
        if numeric_values is None:
            return input_ids, inputs_embeds
        if not self.config.numeric:
            raise ValueError("numeric_values were given but this model has numeric=False: drop them, or build the "
                             "heads with numeric=True")
        if input_ids is None:
            raise ValueError("numeric_values need the input as input_ids (which positions are <NUM> is read from the "
                             "tokens): pass input_ids instead of inputs_embeds")
        check_numeric_values(numeric_values, input_ids.shape, "the input tokens", input_ids, self.config.num_token_id)
        if inputs_embeds is None:
            # The backbone's own embedding module (Gemma's scales by √H inside it), so v = 0 is the base's input.
            inputs_embeds = self.model.get_input_embeddings()(input_ids)
        return None, self.numeric.read(lambda numeric, embeds: numeric.embed(embeds, numeric_values), inputs_embeds)

    def numeric_prediction(self, loc_U, scale_U, mode="standard", temperature=1.0, noise=None):
        """(loc_Y, scale_Y) of numeric models, on U fused as the mode fuses it; (None, None) otherwise."""
        if not self.config.numeric:
            return None, None
        return self.action.read(
            lambda action, loc, scale: self.numeric.predict(loc, scale, action.b_noise, mode, temperature, noise),
            loc_U, scale_U)

    def causal_heads(self, z, inference_mode="standard", causal_temperature=1.0, noise=None):
        """z ↦ (loc_U, scale_U, loc_S, scale_S): abduction, then the action network's noise fusion and linear law.
        The mode, the temperature and the noise ε (`sampling`) are checked here, where every caller enters.
        `compatible` scores with loc_S alone: its scale_S is None, and so is scale_U (the scale path does not run)
        except in numeric models, whose loc_Y, scale_Y read it."""
        inference_mode, causal_temperature = self._resolve_mode(inference_mode, causal_temperature)
        return self._causal_heads(z, inference_mode, causal_temperature, noise)

    def _causal_heads(self, z, mode, temperature, noise):
        # `causal_heads` once the mode and the temperature are checked (`forward` checks them on entry)
        if noise is not None and mode == "sampling":
            noise = check_causal_noise(noise, z.shape[:-1], self.config.causal_size, self.action.bias.dtype)
            noise = noise.to(z.device)
        dtype = self.action.bias.dtype
        if z.dtype != dtype:  # the heads' dtype (a backbone's norm may return float32)
            z = z.to(dtype)
        loc_U, scale_U = self.abduction(z, scale=mode != "compatible" or self.config.numeric)
        loc_S, scale_S = self.action(loc_U, scale_U, mode, temperature, noise)
        return loc_U, scale_U, loc_S, scale_S

    def ovr_log_probs(self, loc_S, scale_S):
        """log P_k, the one-vs-rest log-probabilities (float32)."""
        return ovr_log_prob(self.ovr(loc_S, scale_S))

    def mode_scores(self, loc_S, scale_S, inference_mode, log_P=None):
        """The logits a mode decodes with (docs/design.md, Inference modes): loc_S in `compatible`, in the OvR modes
        `cauchy.ovr_decision_scores` of the config's `ovr_distribution`. `log_P` may be passed when the caller
        already has it. Without gradient, at a vocabulary that makes it worth a kernel, one kernel: the
        `causalqwen::ovr_scores` operator where the installed package registered one (dispatch.py), else the torch
        code, eager."""
        if inference_mode == "compatible":
            return loc_S
        # The config is a plain object: a value set after loading is checked where it is used.
        check_choice("ovr_distribution", self.config.ovr_distribution, OVR_DISTRIBUTIONS)
        return self.ovr.read(lambda ovr, loc, scale: self._decision_scores(loc, scale, ovr, log_P), loc_S, scale_S)

    def _decision_scores(self, loc_S, scale_S, ovr, log_P):
        args = (loc_S, scale_S, ovr.threshold, ovr.relative, self.config.ovr_distribution)
        if log_P is None and fused_decode_applies(self.config.vocab_size * self.config.causal_size, loc_S, scale_S):
            scores = run_operator("ovr_scores", *args)
            if scores is not None:
                return scores
        return ovr_decision_scores(*args, log_P=log_P)

    def _resolve_mode(self, inference_mode, causal_temperature, noise_sharing="step"):
        mode = self.config.inference_mode if inference_mode is None else inference_mode
        temperature = self.config.causal_temperature if causal_temperature is None else causal_temperature
        check_choice("inference_mode", mode, INFERENCE_MODES)
        # in the dtype T·|b_noise| is computed in: 1e39 is a finite float64, and inf in float32 or bfloat16
        temperature = check_number("causal_temperature", temperature, minimum=0, dtype=self.action.bias.dtype)
        check_choice("noise_sharing", noise_sharing, NOISE_SHARING)
        return mode, temperature

    def _sampling_noise(self, z, mode, noise_sharing, causal_noise):
        """ε ~ Cauchy(0, 1) for `sampling`: one per position (`step`), or one per sequence reused at
        every position and step (`sequence`, carried across steps through `causal_noise`)."""
        if mode != "sampling":
            return None
        if causal_noise is not None:
            return causal_noise  # checked by _causal_heads, where every caller's ε enters
        batch, length = z.shape[:2]
        shape = (batch, 1 if noise_sharing == "sequence" else length, self.config.causal_size)
        return sample_standard_cauchy(shape, dtype=self.action.bias.dtype, device=z.device)

    def _scores(self, z, mode, temperature, noise_sharing, causal_noise):
        noise = self._sampling_noise(z, mode, noise_sharing, causal_noise)
        return (*self._causal_heads(z, mode, temperature, noise), noise)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, logits_to_keep=0, inference_mode=None, causal_temperature=None, noise_sharing="step",
                causal_noise=None, numeric_values=None, **kwargs) -> CausalQwenModelOutput:
        _, outputs = self._forward_fields(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                          use_cache, logits_to_keep, inference_mode, causal_temperature, noise_sharing,
                                          causal_noise, numeric_values, kwargs)
        return CausalQwenModelOutput(**outputs)

    def _forward_fields(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache,
                        logits_to_keep, inference_mode, causal_temperature, noise_sharing, causal_noise, numeric_values,
                        kwargs) -> tuple[str, dict]:
        """`forward`'s work: the mode it scored in and the fields of its output, as a dict (the causal LM builds its
        own output from them, one output object per call)."""
        mode, temperature = self._resolve_mode(inference_mode, causal_temperature, noise_sharing)
        outputs = self._run_backbone(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache,
                                     kwargs, numeric_values)
        z = _keep_positions(outputs.last_hidden_state, logits_to_keep)
        loc_U, scale_U, loc_S, scale_S, noise = self._scores(z, mode, temperature, noise_sharing, causal_noise)
        loc_Y, scale_Y = self.numeric_prediction(loc_U, scale_U, mode, temperature, noise)
        return mode, {
            "loc_U": loc_U,
            "scale_U": scale_U,
            "loc_S": loc_S,
            "scale_S": scale_S,
            "causal_noise": noise,
            "loc_Y": loc_Y,
            "scale_Y": scale_Y,
            "last_hidden_state": outputs.last_hidden_state,
            CACHE_NAME: getattr(outputs, CACHE_NAME),
            "hidden_states": outputs.hidden_states,
            "attentions": outputs.attentions,
        }

    # ------------------------------------------------------------------ checks

    @torch.no_grad()
    def _base_output_layer(self, device) -> tuple:
        """(weight, bias) of the base's output layer: the one `from_base` kept, else (an untied base the caller
        released) read back from the base checkpoint's file onto `device`."""
        lm_head = getattr(self, "_base_lm_head", None)
        if isinstance(lm_head, weakref.ref):
            lm_head = lm_head()
        if lm_head is not None:
            return lm_head.weight, lm_head.bias
        name = self.config.base_model_name_or_path
        try:
            found = read_output_layer(name, self.config.base_model_revision) if name else None
        except OSError:  # the folder gone, the Hub out of reach
            found = None
        if found is None:
            raise ValueError(
                f"no base output layer to compare against: the model was not built by from_base, and no lm_head "
                f"tensor could be read from its base {name!r}: pass base_model=<the base causal LM>"
            )
        return tuple(t if t is None else t.to(device) for t in found)

    def verify_initialization(self, input_ids, attention_mask=None, base_model=None) -> dict[str, float]:
        """How far the fresh CausalQwen is from its base (docs/design.md, Action network: the invariant).

        Compares against `base_model` when given (a separately loaded base causal LM), else
        against the base lm_head kept by `from_base` on the shared backbone.
        """
        z = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        loc_U, scale_U, loc_S, scale_S = self.causal_heads(z, "standard", 1.0)
        probs = ovr_probs(self.ovr(loc_S, scale_S))
        if base_model is not None:
            base_out = base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            z_base, base_logits = base_out.hidden_states[-1], base_out.logits
        else:
            weight, bias = self._base_output_layer(z.device)
            z_base = z
            base_logits = F.linear(z.to(weight), weight, None if bias is None else bias.to(weight))
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        z, z_base, base_logits, probs = z[mask].float(), z_base[mask].float(), base_logits[mask].float(), probs[mask]
        loc_U, scale_U, loc_S = loc_U[mask].float(), scale_U[mask].float(), loc_S[mask].float()
        log_q = F.log_softmax(loc_S, -1)
        return {
            "feature_diff": (_rel_diff(z, z_base)),
            "loc_U_vs_z": _rel_diff(loc_U, z) if loc_U.shape == z.shape else float("nan"),
            "scale_U_mean": scale_U.mean().item(),
            "scale_U_std": scale_U.std().item() if scale_U.numel() > 1 else 0.0,
            "logits_diff": _rel_diff(loc_S, base_logits),
            "kl_to_base": (log_q.exp() * (log_q - F.log_softmax(base_logits, -1))).sum(-1).mean().item(),
            "ovr_prob_mean": probs.mean().item(),
            "ovr_prob_max": probs.max().item(),
            "ovr_prob_min": probs.min().item(),
            "ovr_prob_sum": probs.sum(-1).mean().item(),
        }


class CausalQwenForCausalLM(CausalGenerationMixin, CausalQwenModel, GenerationMixin):
    """CausalQwen as a causal LM: `logits` per the inference mode (docs/design.md, Inference modes); with `labels`, the training loss.

    The model owns its losses, as every transformers causal LM does: `model(input_ids, labels=labels)` returns the
    loss the config names (`objective`: the OvR loss, or the softmax cross-entropy of loc_S; plus
    `softmax_loss_weight` × that cross-entropy beside the OvR loss, and the numeric NLL of numeric heads), computed in
    token × vocabulary tiles over the positions that have a target. That path returns no [tokens × V] scores
    (`logits` is None) and runs a frozen backbone without autograd. `model(hidden_state=z, topk_ids=..., topk_probs=...)`
    returns the top-K distillation loss on stored features (the backbone does not run).
    """

    # Target tokens per chunk of the losses; None: as many as a chunk's logits budget holds (losses.chunk_tokens).
    loss_chunk_size: int | None = None

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, inference_mode=None, causal_temperature=None,
                noise_sharing="step", causal_noise=None, numeric_values=None, shift_labels=None,
                num_items_in_batch=None, hidden_state=None, topk_ids=None, topk_probs=None,
                **kwargs) -> CausalQwenCausalLMOutput:
        """`CausalQwenModel.forward`'s arguments (named, so that generate() catches a misspelt one), plus the losses'
        inputs: `labels` (or `shift_labels`) for the training loss, or `hidden_state`, `topk_ids`, `topk_probs` for
        the distillation loss on stored features. The losses are the same in every inference mode and keep no
        cache: the scoring options do not apply to them."""
        if hidden_state is not None or topk_ids is not None or topk_probs is not None:
            if hidden_state is None or topk_ids is None or topk_probs is None:
                raise ValueError("the distillation loss needs hidden_state, topk_ids and topk_probs together")
            return self._distillation_loss(hidden_state, topk_ids, topk_probs)
        if labels is not None or shift_labels is not None:
            if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
                raise ValueError("labels need scores at every position: call with logits_to_keep=0")
            return self._training_loss(input_ids, attention_mask, position_ids, inputs_embeds, numeric_values, labels,
                                       shift_labels, num_items_in_batch, kwargs)

        mode, out = self._forward_fields(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                         use_cache, logits_to_keep, inference_mode, causal_temperature, noise_sharing,
                                         causal_noise, numeric_values, kwargs)
        del out["last_hidden_state"]  # the heads have read it
        return CausalQwenCausalLMOutput(logits=self.mode_scores(out["loc_S"], out["scale_S"], mode), **out)

    # ------------------------------------------------------------------ losses

    def _training_loss(self, input_ids, attention_mask, position_ids, inputs_embeds, numeric_values, labels,
                       shift_labels, num_items_in_batch, kwargs) -> CausalQwenCausalLMOutput:
        # A frozen backbone needs no autograd graph: no activations kept, no backward through the layers. The numeric
        # direction d enters at the input embedding, so training it needs the backward through the layers.
        trains_backbone = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.model.parameters())
            or (numeric_values is not None and self.config.numeric and self.numeric.direction.requires_grad)
        )
        with torch.set_grad_enabled(trains_backbone):
            hidden = self._run_backbone(input_ids, attention_mask, position_ids, None, inputs_embeds, False, kwargs,
                                        numeric_values).last_hidden_state
        targets = _shift_labels(labels) if shift_labels is None else shift_labels
        targets = targets.reshape(-1).to(hidden.device)
        valid = targets != -100
        values = None
        if numeric_values is not None:
            values = _shift_labels(numeric_values.float(), fill=0.0).reshape(-1).to(hidden.device)[valid]
        z = hidden.reshape(-1, hidden.shape[-1])[valid]
        return self.heads_loss(z, targets[valid], values, num_items_in_batch)

    def heads_loss(self, z, targets, numeric_values=None, num_items_in_batch=None) -> CausalQwenCausalLMOutput:
        """The training loss of the heads on the final hidden states `z` [N, H] of positions with a target.

        `targets` [N] are the next tokens; `numeric_values` [N] their values (numeric heads). The loss is the sum over
        targets divided by N, or by `num_items_in_batch` (gradient accumulation: the targets of the whole step; 0
        when the step has none, and the loss is then 0). Returns the loss and `metrics`: for each name a [sum, count]
        tensor, detached, so that callers can average over any window.
        """
        config = self.config
        n = len(targets)
        denom = max(n, 1) if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).clamp_min(1)
        # Loss math in float32 whatever the autocast (the kernels upcast themselves); the products with W_A in
        # autocast's dtype when it is on, as lm_head's F.linear would run.
        device = z.device.type
        matmul_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        with torch.autocast(device, enabled=False):
            loc_U, scale_U = self.abduction(z.to(self.action.bias.dtype))
            count = torch.tensor(float(n), device=z.device)
            metrics = {
                "units_mean_loc": _sum_count(loc_U.detach().float().mean(-1).sum(), count),
                "units_mean_scale": _sum_count(scale_U.detach().float().mean(-1).sum(), count),
            }

            def loss_of(head: DecisionHead, b_noise, loc_U, scale_U):
                # the cross-entropy and the OvR loss (lm_loss.training_loss), then the numeric NLL
                loss, stats = training_loss(loc_U, scale_U, head, targets, config, num_items_in_batch=denom,
                                            chunk_size=self.loss_chunk_size, matmul_dtype=matmul_dtype)
                if config.numeric:  # λ · Σ NLL over the same denominator
                    nll = self.numeric.nll(loc_U, scale_U, b_noise, targets, numeric_values, config.num_token_id)
                    loss = loss + config.numeric_loss_weight * nll.sum() / denom
                    stats["numeric_nll"] = nll.detach()
                return loss, stats

            loss, stats = self._with_decision_head(loss_of, loc_U, scale_U)
            # means per target, kept as sums: softmax_nll (free: the pass computes it whatever its weight), P_y, Σ_k P_k
            metrics.update({name: _sum_count(stats[name] * n, count)
                            for name in ("softmax_nll", "target_prob", "ovr_prob_sum", "candidate_prob_sum")
                            if name in stats})
            if "numeric_nll" in stats:
                nll = stats["numeric_nll"]
                metrics["numeric_nll"] = _sum_count(nll.sum(), torch.tensor(float(nll.numel()), device=z.device))
        return CausalQwenCausalLMOutput(loss=loss, metrics=metrics)

    def _with_decision_head(self, fn, loc_U, scale_U, keep_location=True):
        """`fn(head, b_noise, loc_U, scale_U)` with the action network's tensors as the losses read them
        (`losses.DecisionHead`: W_A as used — own, tied or base + B·A —, b_A, b_noise, the thresholds), computed
        inside the forwards of the action network and the thresholds' module (`HeadModule.read`): where FSDP2 and
        ZeRO-3 have gathered their parameters. Without `keep_location` W_A and b_A are detached."""
        location = (lambda t: t) if keep_location else (lambda t: None if t is None else t.detach())

        def with_action(action, loc, scale, threshold):
            head = DecisionHead(location(action.effective_weight()), location(action.bias), action.b_noise, threshold)
            return fn(head, action.b_noise, loc, scale)

        return self.ovr.read(
            lambda ovr: self.action.read(lambda action, loc, scale: with_action(action, loc, scale, ovr.threshold),
                                         loc_U, scale_U))

    def _distillation_loss(self, hidden_state, topk_ids, topk_probs) -> CausalQwenCausalLMOutput:
        """Top-K MSE plus the tail term (docs/design.md, Offline distillation) on stored z [..., H], mean over
        positions; the backbone does not run. Without `ovr_trains_location` the losses reach only the scale path and
        the thresholds: the locations (W_loc, b_loc, W_A, b_A), which rank the tokens, keep the teacher's ranking
        (loc_S is the base's logits at init)."""
        z = hidden_state.reshape(-1, hidden_state.shape[-1])
        keep = self.config.ovr_trains_location

        def loss_of(head: DecisionHead, b_noise, loc_U, scale_U):
            lse = log_partition(loc_U, head, self.loss_chunk_size) if self.config.ovr_relative_threshold else None
            return topk_mse_loss(
                loc_U if keep else loc_U.detach(), scale_U, head, topk_ids.reshape(len(z), -1),
                topk_probs.reshape(len(z), -1), tail_weight=self.config.distill_tail_weight, threshold_offset=lse,
                chunk_size=self.loss_chunk_size,
            )

        with torch.autocast(z.device.type, enabled=False):
            loc_U, scale_U = self.abduction(z.to(self.action.bias.dtype))
            loss, stats = self._with_decision_head(loss_of, loc_U, scale_U, keep_location=keep)
        count = torch.tensor(float(len(z)), device=z.device)
        return CausalQwenCausalLMOutput(loss=loss, metrics={k: _sum_count(v * len(z), count) for k, v in stats.items()})

# --------------------------------------------------------------------------------------- helpers


def _keep_positions(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The positions the heads score: the last `logits_to_keep` (0 = all), or the given indices."""
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:]
    return hidden[:, logits_to_keep]


def _shift_labels(labels: torch.Tensor, fill=-100) -> torch.Tensor:
    """Position t predicts token t + 1, like every transformers causal LM; the last position has no target."""
    return F.pad(labels, (0, 1), value=fill)[..., 1:]


def _sum_count(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.stack([total.detach().float(), count.float()])


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


__all__ = ["CausalQwenPreTrainedModel", "CausalQwenModel", "CausalQwenForCausalLM", "AbductionNetwork", "ActionNetwork", "OvRClassifier"]
