"""The causal heads as modules: abduction (z → U), action (U → S by the Cauchy linear law), the OvR thresholds and
the numeric head (docs/design.md, Abduction network to Numbers). Each forward is the formula of the design document;
the math itself lives in `cauchy.py`.

Shipped as remote code: imports only the standard library and torch.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from .cauchy import (
    cauchy_linear,
    cauchy_linear_blocked,
    cauchy_nll,
    cauchy_regression,
    fuse_noise,
    ovr_standardize,
    signed_log1p,
    softplus_inverse,
)
from .dispatch import run_operator
from .sharding import HeadModule, full_tensor, gathered

# Decoding asks for fused kernels where the installed package registered them (dispatch.py): one read of W_A for loc_S
# and scale_S (the causalqwen::cauchy_linear operator), and the OvR modes' scores in one pass (causalqwen::ovr_scores);
# the torch code otherwise, eager (the remote code compiles nothing). CAUSALQWEN_FUSED_DECODE=0 runs the torch code.
_FUSED_DECODE = os.environ.get("CAUSALQWEN_FUSED_DECODE", "1") != "0"
_FUSED_MIN_NUMEL = 1 << 22  # below this W_A is cheap to read twice, and not worth a kernel's compilation


def no_gradient(*tensors: torch.Tensor) -> bool:
    """Nothing to differentiate: grad mode off, or none of the tensors requires a gradient (inference)."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def fused_decode_applies(weight_numel: int, *tensors: torch.Tensor) -> bool:
    """Whether inference asks for the decode operators: enabled, no gradient to compute, and a W_A large enough to
    repay a kernel's compilation (tiny models run the torch code)."""
    return _FUSED_DECODE and no_gradient(*tensors) and weight_numel >= _FUSED_MIN_NUMEL


class AbductionNetwork(nn.Module):
    """z ↦ Cauchy individual U: loc_U = W_loc z + b_loc, scale_U = softplus(W_scale z + b_scale).

    Without `scale` the forward returns (loc_U, None): a score that reads only loc_U (the `compatible` mode) skips the
    scale path. Both linear maps are read inside this forward either way (sharded engines gather the module whole).
    """

    def __init__(self, hidden_size: int, causal_size: int):
        super().__init__()
        self.loc = nn.Linear(hidden_size, causal_size)
        self.scale = nn.Linear(hidden_size, causal_size)

    def forward(self, z: torch.Tensor, scale: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.loc(z), F.softplus(self.scale(z)) if scale else None

    @torch.no_grad()
    def reset_parameters(self, gamma_init: float) -> None:
        """Identity when C == H (U starts at z with constant scale γ₀); Xavier otherwise."""
        if self.loc.in_features == self.loc.out_features:
            self.loc.weight.copy_(torch.eye(self.loc.out_features))
            self.scale.weight.zero_()
        else:
            nn.init.xavier_uniform_(self.loc.weight)
            nn.init.xavier_uniform_(self.scale.weight)
            self.scale.weight.mul_(0.1)
        self.loc.bias.zero_()
        self.scale.bias.fill_(softplus_inverse(gamma_init))


class ActionNetwork(HeadModule):
    """Cauchy linear law U ↦ S: loc_S = W_A loc_U' + b_A, scale_S = scale_U' |W_A|ᵀ, after noise fusion.

    `action_weight` says where W_A lives:
    - "full": a [V, C] parameter of its own (trained, saved);
    - "tied": the base's output-embedding tensor itself (shared, frozen, never saved);
    - "lora": W_base + B·A with A [r, C], B [V, r]; only A and B are trained and saved.
    For "tied"/"lora" the model hands the module the base module holding W_base (`bind_base_weight`); under sharded
    training W_base is gathered whole wherever the module reads it (it is frozen: no gradient to route back).
    The losses read W_A, b_A and b_noise through `read` (`HeadModule`).
    """

    def __init__(self, causal_size: int, vocab_size: int, action_weight: str = "full", lora_rank: int = 16):
        super().__init__()
        self.action_weight = action_weight
        if action_weight == "full":
            self.weight = nn.Parameter(torch.empty(vocab_size, causal_size))
        elif action_weight == "lora":
            self.lora_A = nn.Parameter(torch.empty(lora_rank, causal_size))
            self.lora_B = nn.Parameter(torch.empty(vocab_size, lora_rank))
        self.bias = nn.Parameter(torch.empty(vocab_size))
        self.b_noise = nn.Parameter(torch.empty(causal_size))
        self._base_owner = None  # module whose .weight is W_base ("tied"/"lora"); outside the module tree
        self._merged_cache = None  # (key, W_base + B·A) for inference; never saved

    def bind_base_weight(self, owner: nn.Module) -> None:
        # Stored in __dict__, not as a submodule: the tensor belongs to the base, which owns and moves it.
        self.__dict__["_base_owner"] = owner

    def effective_weight(self) -> torch.Tensor:
        """W_A as used by the linear law (differentiable in its trainable parts). Called inside the module's forward
        (or `read`), where a sharded W_base is gathered."""
        if self.action_weight == "full":
            return self.weight
        base = full_tensor(self._base_owner.weight)
        if self.action_weight == "tied":
            return base
        if torch.is_grad_enabled() and (self.lora_A.requires_grad or self.lora_B.requires_grad):
            self._merged_cache = None
            return base + self.lora_B @ self.lora_A
        key = (base.data_ptr(), base._version, self.lora_A._version, self.lora_B._version, base.dtype, base.device)
        if self._merged_cache is None or self._merged_cache[0] != key:
            self._merged_cache = (key, (base + self.lora_B @ self.lora_A).detach())
        return self._merged_cache[1]

    def forward(self, loc_U, scale_U, mode="standard", temperature=1.0, noise=None, read=None):
        """(loc_S, scale_S); `compatible` scores with loc_S alone, so its scale_S is None (not computed). With `read`:
        `read(self, loc_U, scale_U)` (`HeadModule.read`)."""
        base = () if self._base_owner is None else (self._base_owner.weight,)
        with gathered(*base):  # ZeRO-3: W_base whole for this call
            if read is not None:
                return read(self, loc_U, scale_U)
            return self._linear_law(loc_U, scale_U, mode, temperature, noise)

    def _linear_law(self, loc_U, scale_U, mode, temperature, noise):
        weight = self.effective_weight()
        if mode == "compatible":  # no noise fusion, no scale (scale_U may be None)
            return F.linear(loc_U, weight, self.bias), None
        loc_U, scale_U = fuse_noise(loc_U, scale_U, self.b_noise, mode, temperature, noise)
        tensors = (loc_U, scale_U, weight, self.bias)
        if fused_decode_applies(weight.numel(), *tensors):
            fused = run_operator("cauchy_linear", loc_U, scale_U, weight, self.bias)  # dispatch.py
            if fused is not None:
                return fused
        if no_gradient(*tensors):
            return cauchy_linear_blocked(loc_U, scale_U, weight, self.bias)  # no second [V × C] tensor
        return cauchy_linear(loc_U, scale_U, weight, self.bias)

    @torch.no_grad()
    def reset_parameters(self, b_noise_init: float, weight=None, bias=None) -> None:
        """W_A ← a copy of the base lm_head ("full"; random when none is given) or the base itself
        ("tied"; "lora" starts at B = 0 with A like PEFT's LoRA); b_A ← the base bias or 0."""
        if self.action_weight == "full":
            if weight is None:
                nn.init.normal_(self.weight, std=0.02)
            else:
                self.weight.copy_(weight)
        elif self.action_weight == "lora":
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            self.lora_B.zero_()
        if bias is None:
            self.bias.zero_()
        else:
            self.bias.copy_(bias)
        self.b_noise.fill_(b_noise_init)


class OvRClassifier(HeadModule):
    """One-vs-rest thresholds C_k: a scalar buffer, or one learnable value per vocabulary entry; `relative`
    thresholds are compared with loc_S_k − logsumexp_j loc_S_j, the compatible model's log-probability. The losses
    and the decision scores read the thresholds through `read` (`HeadModule`)."""

    def __init__(self, vocab_size: int, threshold_init: float, learnable: bool, relative: bool = False):
        super().__init__()
        self.threshold_init = threshold_init
        self.relative = relative
        if learnable:
            self.threshold = nn.Parameter(torch.empty(vocab_size))
        else:
            self.register_buffer("threshold", torch.empty(()), persistent=False)

    def forward(self, loc_S: torch.Tensor | None = None, scale_S: torch.Tensor | None = None, read=None):
        """Standardized scores x_k = (loc_S_k − C_k) / scale_S_k in float32 (loc_S: full rows [..., V]). With `read`:
        `read(self, *tensors)` for the tensors given (`HeadModule.read`)."""
        if read is not None:
            return read(self, *(t for t in (loc_S, scale_S) if t is not None))
        loc_S = torch.log_softmax(loc_S.float(), -1) if self.relative else loc_S.float()
        return ovr_standardize(loc_S, scale_S.float(), self.threshold.float())

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.threshold.fill_(self.threshold_init)


class NumericHead(HeadModule):
    """Numbers in and out (docs/design.md, Numbers): the input direction d and the Cauchy regression head of `<NUM>` values.

    In: e = embed(token) + φ(v)·d, φ(v) = sign(v)·ln(1 + |v|), so v = 0 leaves the embedding exactly as it was.
    Out: Y ~ Cauchy(w·loc_U' + b, |w|·scale_U' + exp(s)) on the noise-fused individual U'.
    """

    def __init__(self, hidden_size: int, causal_size: int):
        super().__init__()
        self.direction = nn.Parameter(torch.empty(hidden_size))
        self.weight = nn.Parameter(torch.empty(causal_size))
        self.bias = nn.Parameter(torch.empty(()))
        self.log_scale = nn.Parameter(torch.empty(()))

    def embed(self, inputs_embeds: torch.Tensor, numeric_values: torch.Tensor) -> torch.Tensor:
        """e = embed(token) + φ(v)·d, for one value per token (checked: same shape, finite). Reads d: call it through
        `read` under sharded training."""
        values = check_numeric_values(numeric_values, inputs_embeds.shape[:-1])
        phi = signed_log1p(values.to(inputs_embeds.device)).unsqueeze(-1)
        return inputs_embeds + (phi * self.direction.float()).to(inputs_embeds.dtype)

    def forward(self, loc_U: torch.Tensor, scale_U: torch.Tensor | None = None, read=None):
        """(loc_Y, scale_Y) in float32 from the fused individual (loc_U', scale_U'). With `read`:
        `read(self, *tensors)` for the tensors given (`HeadModule.read`)."""
        if read is not None:
            return read(self, *(t for t in (loc_U, scale_U) if t is not None))
        return cauchy_regression(loc_U.float(), scale_U.float(), self.weight.float(), self.bias.float(),
                                 self.log_scale.float())

    def predict(self, loc_U, scale_U, b_noise, mode="standard", temperature=1.0, noise=None):
        """(loc_Y, scale_Y) on the individual fused with the action network's noise as `mode` fuses it."""
        return self(*fuse_noise(loc_U, scale_U, b_noise, mode, temperature, noise))

    def nll(self, loc_U, scale_U, b_noise, targets, values, num_token_id: int) -> torch.Tensor:
        """Cauchy NLL (training fusion) of the value of every `<NUM>` target, [number of <NUM> targets].

        `targets` (token ids, −100 for none) and `values` (their numeric values) are aligned with the positions of
        `loc_U`/`scale_U`, i.e. already shifted.
        """
        is_number = targets == num_token_id
        if not is_number.any():
            return loc_U.new_zeros(0, dtype=torch.float32)
        if values is None:
            raise ValueError("the labels hold <NUM> targets but no numeric_values were given: pass the value of every "
                             "<NUM> token (0 elsewhere)")
        loc_Y, scale_Y = self.predict(loc_U[is_number], scale_U[is_number], b_noise)
        return cauchy_nll(values.to(loc_Y.device)[is_number].float(), loc_Y, scale_Y)

    @torch.no_grad()
    def reset_parameters(self, median: float = 0.0, scale: float = 1.0) -> None:
        """d ~ N(0, 0.02²) normalised to unit length; w Xavier with gain 0.01; b = median, exp(s) = scale
        (the median and IQR/2 of the training targets, so a fresh head predicts Cauchy(median, IQR/2))."""
        if not scale > 0:
            raise ValueError(f"the initial scale of the numeric head must be > 0, got {scale}")
        nn.init.normal_(self.direction, std=0.02)
        self.direction.div_(self.direction.norm())
        nn.init.xavier_uniform_(self.weight.view(1, -1), gain=0.01)
        self.bias.fill_(median)
        self.log_scale.fill_(math.log(scale))


def check_finite_tensor(name: str, tensor, dtype: torch.dtype, expected: str) -> torch.Tensor:
    """`tensor` cast to `dtype`, the dtype it is computed in, or a ValueError naming `name`: not a tensor, or a value
    that is not finite there (1e39 is a finite float64 but inf in float32). `expected` says what it should be."""
    if not torch.is_tensor(tensor):
        raise ValueError(f"{name} must be a torch.Tensor ({expected}), got a {type(tensor).__name__}: pass "
                         f"torch.tensor(...)")
    cast = tensor.to(dtype)
    if torch.compiler.is_compiling():  # a traced graph cannot branch on values: the check stops the compiled call
        torch._assert_async(torch.isfinite(cast).all(), f"{name} holds a value that is not finite in "
                            f"{str(dtype).removeprefix('torch.')}: {expected}, every value a finite number")
        return cast
    bad = ~torch.isfinite(cast)
    if bad.any():
        index = tuple(i.item() for i in bad.nonzero()[0])
        value = tensor[index].item()
        where = f" at {list(index)}" if index else ""
        reason = "" if not math.isfinite(value) else (
            f", which is {cast[index].item()} in {str(dtype).removeprefix('torch.')}, the dtype it is computed in")
        raise ValueError(f"{name} holds {value}{where}{reason}: {expected}, every value a finite number")
    return cast


def check_numeric_values(numeric_values, shape=None, against: str = "the input tokens", input_ids=None,
                         num_token_id: int | None = None) -> torch.Tensor:
    """The `<NUM>` values as float32, where φ(v) is computed: a tensor of `shape` (one value per token of `against`),
    every value finite (a NaN would turn every later score into NaN) and, given the tokens, 0 wherever the token is not
    `<NUM>` (one rule for forward, generate and the collator: a value counts only at a `<NUM>`)."""
    expected = "one value per token, 0 where the token is not <NUM>"
    if torch.is_tensor(numeric_values) and shape is not None and tuple(numeric_values.shape) != tuple(shape):
        raise ValueError(f"numeric_values has shape {tuple(numeric_values.shape)}, {against} {tuple(shape)}: pass "
                         f"{expected}")
    values = check_finite_tensor("numeric_values", numeric_values, torch.float32, expected)
    if input_ids is not None and num_token_id is not None:
        stray = (values != 0) & (input_ids.to(values.device) != num_token_id)
        if torch.compiler.is_compiling():  # as in check_finite_tensor
            torch._assert_async(~stray.any(), f"numeric_values holds a value where the token is not <NUM> "
                                f"({num_token_id}): a value counts only at a <NUM> token; set the others to 0")
        elif stray.any():
            index = tuple(i.item() for i in stray.nonzero()[0])
            raise ValueError(
                f"numeric_values holds {values[index].item()} at {list(index)}, where the token is "
                f"{input_ids[index].item()}, not <NUM> ({num_token_id}): a value counts only at a <NUM> token; set "
                "the others to 0 (encode_with_numbers lines them up)"
            )
    return values


def check_causal_noise(noise, positions, causal_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The `sampling` mode's ε given by a caller, as `dtype`: [*positions, C] for one ε per position, or 1 in a
    position dimension after the first for one ε shared along it ([batch, 1, C]: one per sequence). A larger or
    missing dimension would broadcast into other sequences' scores, so it is refused."""
    want = (*positions, causal_size)
    if torch.is_tensor(noise):
        shape = tuple(noise.shape)
        fits = (len(shape) == len(want) and shape[-1] == causal_size and (not positions or shape[0] == want[0])
                and all(n in (1, p) for n, p in zip(shape[1:-1], want[1:-1])))
        if not fits:
            raise ValueError(
                f"causal_noise has shape {shape}, the scored positions need {want} (one ε per position) or "
                f"{(*want[:1], *[1] * (len(want) - 2), causal_size)} (one per sequence): pass ε ~ Cauchy(0, 1) of "
                "that shape (causal_size last)"
            )
    return check_finite_tensor("causal_noise", noise, dtype, f"ε ~ Cauchy(0, 1) of shape {want}")


__all__ = [
    "AbductionNetwork", "ActionNetwork", "NumericHead", "OvRClassifier", "check_causal_noise", "check_finite_tensor",
    "check_numeric_values",
]
