"""bench/evidence_numbers.py, its arms: the package's `<NUM>` Cauchy head and the heads a user would write instead
(Gaussian, Student-t, Cauchy with their parametrisation, the digits LM of evidence_digits), how each is trained on
the cached states, and how a trained head (or the constant predictor) is scored on test rows."""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_digits as digits  # noqa: E402
from evidence_numbers_intervals import (  # noqa: E402
    LEVELS,
    SUPPORT,
    calibrated_intervals,
    central_interval,
    interval_metrics,
    median_absolute_error,
    truncated_quantile,
)

DF_LR_RATIO = 30.0  # the Student-t head's ν learns at this multiple of the head's learning rate


# --- arms -------------------------------------------------------------------------------------------------------


class LocationScalePrediction:
    """The median and central intervals of a head whose law is loc + scale·X, X its family's standard law."""

    def predict(self, z, levels, support=None):
        """(median, {level: (lower, upper)}); None when the head gives a non-finite location or a scale not > 0. With
        `support` = (low, high), those of the law restricted to that range (`truncated_quantile`)."""
        loc, scale = self(z)
        if not (torch.isfinite(loc).all() and torch.isfinite(scale).all() and (scale > 0).all()):
            return None
        df = self.law().get("df")
        if support is None:
            return loc, {level: central_interval(self.family, loc, scale, level, df) for level in levels}

        def quantile(p):
            return truncated_quantile(self.family, loc, scale, p, support, df)

        return quantile(0.5), {level: (quantile((1 - level) / 2), quantile((1 + level) / 2)) for level in levels}


class PackageCauchyHead(LocationScalePrediction, torch.nn.Module):
    """The package's numeric path on z: AbductionNetwork → standard-mode noise fusion → NumericHead, fresh as
    `from_base(numeric=True)` makes it (the config's γ₀ and b_noise, b = median, exp(s) = IQR/2 of the targets)."""

    family = "cauchy"

    def __init__(self, hidden_size: int, targets: torch.Tensor):
        super().__init__()
        from causalqwen_adapter.heads import AbductionNetwork, NumericHead
        from causalqwen_adapter.numeric import numeric_statistics

        config = self.config()
        self.abduction = AbductionNetwork(hidden_size, hidden_size)
        self.abduction.reset_parameters(config.gamma_init)
        self.numeric = NumericHead(hidden_size, hidden_size)
        self.numeric.reset_parameters(*numeric_statistics(targets))
        self.register_buffer("b_noise", torch.full((hidden_size,), config.b_noise_init))  # the action network's, frozen
        # what bench/numeric.py trains: the numeric head and the abduction scale path (d only matters for inputs)
        for name, param in self.named_parameters():
            param.requires_grad_(name.startswith(("numeric.", "abduction.scale.")) and name != "numeric.direction")

    @staticmethod
    def config():
        """The configuration fresh heads get by default (γ₀ and b_noise are recorded with every run)."""
        from causalqwen_adapter.configuration_causalqwen import CausalQwenConfig

        return CausalQwenConfig()

    def forward(self, z):
        loc_U, scale_U = self.abduction(z)
        return self.numeric.predict(loc_U, scale_U, self.b_noise)

    def nll(self, z, y):
        from causalqwen_adapter.cauchy import cauchy_nll

        return cauchy_nll(y, *self(z))

    def law(self):
        return {}


def cauchy_log_mass(loc: torch.Tensor, scale: torch.Tensor, support: tuple[float, float]) -> torch.Tensor:
    """log P(low ≤ Y ≤ high) of Y ~ Cauchy(loc, scale), in float64: log((atan(u) − atan(v))/π), u = (high − loc)/scale,
    v = (low − loc)/scale, the difference taken as atan((u − v)/(1 + uv)) where uv > −1 (loc outside the range, where
    the two angles nearly cancel)."""
    low, high = support
    loc, scale = loc.double(), scale.double()
    u, v = (high - loc) / scale, (low - loc) / scale
    same_side = u * v > -1
    angle = torch.where(same_side, torch.atan((high - low) / scale / (1 + u * v).where(same_side, 1.0)),
                        torch.atan(u) - torch.atan(v))
    return torch.log(angle / math.pi)


class RangeCauchyHead(PackageCauchyHead):
    """The package's head trained on its law restricted to SUPPORT: the NLL of the truncated Cauchy, −log f(y) +
    log P(Y ∈ SUPPORT), the range in the loss and not only in the reading (its `nll` metric is that density's)."""

    def nll(self, z, y):
        from causalqwen_adapter.cauchy import cauchy_nll

        loc, scale = self(z)
        return cauchy_nll(y, loc, scale).double() + cauchy_log_mass(loc, scale, SUPPORT)


class ResidualCauchyHead(PackageCauchyHead):
    """A probe of a nonlinear abduction network (not in the package): the package's path with a hidden layer added to
    the location, loc_U = W_loc z + W₂ GELU(W₁ RMSNorm(z)), W₂ zero at the start so that it starts where `cauchy`
    does; trained like it (the numeric head, the scale path and the new layer)."""

    def __init__(self, hidden_size: int, targets: torch.Tensor, width: int = 256):
        super().__init__(hidden_size, targets)
        self.norm = torch.nn.RMSNorm(hidden_size)
        self.up = torch.nn.Linear(hidden_size, width)
        self.down = torch.nn.Linear(width, hidden_size)
        torch.nn.init.zeros_(self.down.weight)
        torch.nn.init.zeros_(self.down.bias)

    def forward(self, z):
        loc_U, scale_U = self.abduction(z)
        loc_U = loc_U + self.down(torch.nn.functional.gelu(self.up(self.norm(z))))
        return self.numeric.predict(loc_U, scale_U, self.b_noise)


class LocationScaleHead(LocationScalePrediction, torch.nn.Module):
    """A head a user would write: location w·z + b, log-scale read from a softplus layer of the abduction scale path's
    size, log σ = v·softplus(W z + c) + s; Gaussian (σ² the variance), Student-t (ν learned) or Cauchy."""

    def __init__(self, hidden_size: int, targets: torch.Tensor, family: str, df_init: float = 4.0):
        super().__init__()
        self.family = family
        targets = targets.double()
        if family == "gaussian":  # what a user starts a Gaussian from: the mean and standard deviation
            loc0, scale0 = targets.mean().item(), targets.std().item()
        else:  # the heavy-tailed laws from the median and IQR/2, as the package's head
            from causalqwen_adapter.numeric import numeric_statistics

            loc0, scale0 = numeric_statistics(targets)
        self.loc = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.xavier_uniform_(self.loc.weight, gain=0.01)
        torch.nn.init.constant_(self.loc.bias, loc0)
        self.hidden = torch.nn.Linear(hidden_size, hidden_size)
        self.log_scale = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.xavier_uniform_(self.log_scale.weight, gain=0.01)
        torch.nn.init.constant_(self.log_scale.bias, math.log(scale0))
        if family == "student_t":  # ν = exp(ρ) > 0
            self.log_df = torch.nn.Parameter(torch.tensor(math.log(df_init)))

    def forward(self, z):
        h = torch.nn.functional.softplus(self.hidden(z))
        return self.loc(z).squeeze(-1), self.log_scale(h).squeeze(-1).exp()

    def df(self):
        return self.log_df.exp()

    def nll(self, z, y):
        loc, scale = self(z)
        if self.family == "gaussian":
            return -torch.distributions.Normal(loc, scale, validate_args=False).log_prob(y)
        if self.family == "student_t":
            return -torch.distributions.StudentT(self.df(), loc, scale, validate_args=False).log_prob(y)
        from causalqwen_adapter.cauchy import cauchy_nll

        return cauchy_nll(y, loc, scale)

    def law(self):
        return {"df": self.df().item()} if self.family == "student_t" else {}


ARMS = {  # arm → fresh head from (its inputs, the training targets)
    "cauchy": lambda z, y: PackageCauchyHead(z.shape[1], y),
    "cauchy_range": lambda z, y: RangeCauchyHead(z.shape[1], y),  # the range in the loss
    "cauchy_residual": lambda z, y: ResidualCauchyHead(z.shape[1], y),  # a nonlinear location (probe)
    "gaussian": lambda z, y: LocationScaleHead(z.shape[1], y, "gaussian"),
    "student_t": lambda z, y: LocationScaleHead(z.shape[1], y, "student_t"),
    "cauchy_free": lambda z, y: LocationScaleHead(z.shape[1], y, "cauchy"),
    "digits": lambda x, y: digits.DigitsHead(x),
    "digits_zero_shot": lambda x, y: digits.DigitsHead(x, train=False),  # the base as it is: what it writes unasked
}
DIGIT_ARMS = ("digits", "digits_zero_shot")  # these read the answer states (evidence_digits), the others z


def train_head(arm: str, x, y, *, lr: float, steps: int, batch_size: int, seed: int):
    """Fresh head of `arm`, AdamW (no weight decay, constant rate, as bench/numeric.py trains the numeric head) on
    minibatches of the mean NLL (the digits arm: of its SFT cross-entropy). A head with nothing to train is returned
    as it starts."""
    torch.manual_seed(seed)
    head = ARMS[arm](x, y)
    loss_of = getattr(head, "training_loss", head.nll)
    if not any(p.requires_grad for p in head.parameters()):
        return head.eval()
    # ν is one scalar: at the head's rate Adam moves log ν by about lr a step, too little to leave its start
    df = [p for name, p in head.named_parameters() if name == "log_df"]
    rest = [p for name, p in head.named_parameters() if p.requires_grad and name != "log_df"]
    groups = [{"params": rest}] + ([{"params": df, "lr": DF_LR_RATIO * lr}] if df else [])
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    batches = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(y), (batch_size,), generator=batches)
        loss = loss_of(x[idx], y[idx]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if not torch.isfinite(loss):
            break
    return head.eval()


def score_head(head, x, y, calibration=None) -> dict:
    """Test metrics of a trained head; non-finite predictions score inf (a diverged run is a loss, not an error).
    With `calibration` = (x, y) of validation rows, also the metrics of its intervals conformally calibrated there
    (`calibrated_*`). The same again for its law read on SUPPORT (`truncated_*`, `truncated_calibrated_*`)."""
    with torch.no_grad():
        prediction = head.predict(x, LEVELS)
        if prediction is None:
            return {"diverged": True, "score": float("inf")}
        nll = head.nll(x, y).double().mean().item()
        x_validation, y_validation = calibration if calibration is not None else (None, None)
        validation = None if x_validation is None else head.predict(x_validation, LEVELS)
        out = {"nll": nll, **prediction_metrics(prediction, y, validation, y_validation)}
        validation = None if x_validation is None else on_support(head, x_validation, validation)
        out |= prediction_metrics(on_support(head, x, prediction), y, validation, y_validation, prefix="truncated_")
    law = head.law() if isinstance(head, LocationScalePrediction) else {}
    return {**out, **law}


def on_support(head, x, prediction):
    """The head's (median, intervals) from its law restricted to SUPPORT: a location-scale law truncated there; any
    other (the digits LM's histogram, already inside) its `prediction` as it is. None where the head's prediction is
    (diverged)."""
    if isinstance(head, LocationScalePrediction):
        prediction = head.predict(x, LEVELS, SUPPORT)
    return None if prediction is None else clipped(prediction)


def clipped(prediction):
    """(median, intervals) with every end clipped to SUPPORT: widening beyond the range covers nothing more (for a
    law inside the range, only float rounding changes)."""
    median, intervals = prediction

    def clip(values):
        return values.double().clamp(*SUPPORT)

    return clip(median), {level: (clip(lower), clip(upper)) for level, (lower, upper) in intervals.items()}


def prediction_metrics(prediction, y, validation=None, y_validation=None, prefix: str = "") -> dict:
    """MedAE and interval metrics of `prediction` = (median, intervals) on targets y, and with a `validation`
    prediction and its targets those of the intervals calibrated on it (`calibrated_`; clipped to SUPPORT under the
    `truncated_` prefix, where widening beyond the range covers nothing more). No calibrated metrics when the
    validation prediction is None (a head diverged there)."""
    median, intervals = prediction
    out = {f"{prefix}median_abs_error": median_absolute_error(median, y), **interval_metrics(intervals, y, prefix)}
    if validation is not None:
        calibrated = calibrated_intervals(validation[1], y_validation, intervals)
        if prefix == "truncated_":
            calibrated = clipped((median, calibrated))[1]
        out |= interval_metrics(calibrated, y, prefix=f"{prefix}calibrated_")
    return out


def score_constant(train_y, y, validation_y=None) -> dict:
    """Every text gets the training targets' median and empirical central intervals (calibrated on `validation_y`
    too, when given, as score_head does)."""
    train_y = train_y.double()
    median = torch.full_like(y, train_y.median().item(), dtype=torch.float64)

    def intervals_for(like):
        out = {}
        for level in LEVELS:
            lo, hi = torch.quantile(train_y, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
            out[level] = torch.full_like(like, lo.item(), dtype=torch.float64), torch.full_like(
                like, hi.item(), dtype=torch.float64)
        return out

    prediction = median, intervals_for(y)
    validation = None if validation_y is None else (None, intervals_for(validation_y))
    # the training targets' quantiles lie inside SUPPORT: the truncated reading clips only float rounding
    return {**prediction_metrics(prediction, y, validation, validation_y),
            **prediction_metrics(clipped(prediction), y, validation, validation_y, prefix="truncated_")}
