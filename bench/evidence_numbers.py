"""Evidence: does the Cauchy `<NUM>` head give better numbers with intervals than the heads a user would pick instead?

Task: VADER's human sentiment ratings (Hutto & Gilbert, ICWSM 2014; the `*_GroundTruth.txt` files of
`additional_resources/hutto_ICWSM_2014.tar.gz` in the vaderSentiment 3.3.2 sdist): text → the mean rating of about ten
people, in [−4, 4], 23,703 texts (tweets, movie and Amazon review snippets, New York Times editorial sentences).

The frozen demo base runs once over a prompt per text; its final hidden state z at the prompt's last token (the
position whose next token would be the answer's `<NUM>`) is cached under --cache, with, when a digits arm runs, the
states before every token of every answer the LM may write (evidence_digits). Every arm then trains on these frozen
states, with the same optimiser, steps and learning-rate grid (picked per arm on validation):

- `cauchy`: the package's numeric path as bench/numeric.py trains it: `AbductionNetwork` (identity location, its scale
  path trained) and `NumericHead` (w, b, s trained) on the standard-mode fused individual, loss `cauchy_nll`, the
  numeric term of `heads_loss` (the OvR term over the vocabulary is left out: it needs a [V × C] product per row and
  trains nothing of the number's law but the same scale path);
- `gaussian`: mean w·z + b, log σ read from softplus(W z + c) (W the size of the abduction scale path);
- `student_t`: the same with a Student-t law and ν learned;
- `cauchy_free`: the baselines' parametrisation with the Cauchy law (separates the law from the parametrisation);
- `digits`: the softmax LM writing the rating with one decimal, its output rows of the answer's tokens trained by the
  SFT cross-entropy, decoding constrained to −4.0 … 4.0 and read exactly (evidence_digits: no regression head at all);
- `digits_zero_shot`: the same with the base's rows untrained (what the base writes when asked);
- `constant`: the training targets' median and empirical quantiles for every text (the floor).

Targets are clean, or with 20% of the training (and validation) targets permuted among their rows ("shuffled": a user
has no clean labels to validate on). The heads trained on shuffled targets are scored on clean test targets
("shuffled") and on test targets shuffled alike ("shuffled_test": the outliers are in the data the intervals must
cover, not only in the training labels). On test: the median absolute error of the
predictive median, and for the 50/80/90/95% central intervals their coverage, mean width and interval (Winkler)
score, each family through its exact quantiles; and the same for each arm's intervals calibrated on the validation
rows (`calibrated_*`: split-conformal offsets per level, the same rule for every arm, so a head whose law has the wrong
shape is judged on how well its intervals rank the texts' uncertainty). Mean ± standard error over seeds (each seed:
split, initialisation, corruption), and the paired differences against `cauchy` on the same splits. Writes
OUTPUT.json and OUTPUT.md.

    python bench/evidence_numbers.py --base /work/demo-base --quick
    python bench/evidence_numbers.py --base /work/demo-base --texts 768 --seeds 5    # BENCHMARKS.md; bench/results/evidence-numbers.md
    python bench/evidence_numbers.py --summarize RUN.json OTHER_ARMS.json --select nll --output BOTH
"""

import argparse
import dataclasses
import hashlib
import io
import json
import math
import os
import platform
import statistics
import sys
import tarfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_digits as digits  # noqa: E402

GROUND_TRUTH_SUFFIX = "_GroundTruth.txt"
INNER_ARCHIVE = "hutto_ICWSM_2014.tar.gz"
PROMPT = 'Text: "{text}"\nSentiment of the text, from -4 (very negative) to 4 (very positive):'
LEVELS = (0.5, 0.8, 0.9, 0.95)
# the range of the ratings the digits LM can write (its histogram's support, −4.05 … 4.05): every arm's law is also
# read restricted to it (the `truncated_*` metrics), the knowledge of the scale that the LM's answers have
SUPPORT = (digits.GRID[0] - digits.bin_width(digits.GRID) / 2, digits.GRID[-1] + digits.bin_width(digits.GRID) / 2)
DF_LR_RATIO = 30.0  # the Student-t head's ν learns at this multiple of the head's learning rate


# --- data -------------------------------------------------------------------------------------------------------


def parse_ground_truth(source: str, content: str) -> list[dict]:
    """Rows of one `*_GroundTruth.txt`: `id<TAB>mean rating<TAB>text`. A missing or non-finite rating is refused,
    naming the file, line and id (a NaN target would silently turn every loss into NaN)."""
    rows = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t", 2)
        where = f"{source} line {number} (id {fields[0].strip()!r})"
        if len(fields) < 3 or not fields[1].strip():
            raise ValueError(f"{where}: no rating; each line must read id<TAB>rating<TAB>text")
        try:
            rating = float(fields[1])
        except ValueError:
            raise ValueError(f"{where}: rating {fields[1]!r} is not a number") from None
        if not math.isfinite(rating):
            raise ValueError(f"{where}: rating {fields[1]!r} is not a finite number")
        rows.append({"source": source, "id": fields[0].strip(), "rating": rating, "text": fields[2].strip()})
    return rows


def read_vader_ratings(path) -> list[dict]:
    """Every `*_GroundTruth.txt` row of a tar: the vaderSentiment sdist (read through its nested
    `hutto_ICWSM_2014.tar.gz`) or that inner archive itself. Sorted by (file, line order)."""
    return _read_tar(tarfile.open(path, "r:*"))


def _read_tar(archive: tarfile.TarFile) -> list[dict]:
    rows = []
    with archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            if not member.isfile():
                continue
            if member.name.endswith(INNER_ARCHIVE):
                rows += _read_tar(tarfile.open(fileobj=io.BytesIO(archive.extractfile(member).read()), mode="r:*"))
            elif member.name.endswith(GROUND_TRUTH_SUFFIX):
                name = Path(member.name).name
                rows += parse_ground_truth(name, archive.extractfile(member).read().decode("utf-8"))
    if not rows:
        raise ValueError(f"no *{GROUND_TRUTH_SUFFIX} file in the archive: pass the vaderSentiment sdist or {INNER_ARCHIVE}")
    return rows


# --- features ---------------------------------------------------------------------------------------------------


def feature_cache_path(cache: Path, base: str, answers: bool = False) -> Path:
    key = hashlib.sha256(f"{Path(base).resolve()}\n{PROMPT}".encode()).hexdigest()[:12]
    return cache / f"vader-{'answers' if answers else 'z'}-{key}.pt"


def extract_features(base: str, rows: list[dict], texts: int, cache: Path, batch_size: int = 16,
                     answers: bool = False) -> dict:
    """z at the last prompt token for the first `texts` rows of a fixed permutation (seed 0) of all rows; resumes a
    partial cache (saved after every batch), so a long extraction can be stopped and continued. With `answers`, also
    the states the digits arm reads (evidence_digits.answer_states; z is their first) and the base's output rows of
    the answer tokens, in a cache of their own. Without `answers`, z is read from (and grown in) the answer states'
    cache when it exists and no cache of z alone does: z is their first state."""
    path = feature_cache_path(cache, base, answers)
    if not answers and not path.exists() and feature_cache_path(cache, base, True).exists():
        path = feature_cache_path(cache, base, True)  # z is the answer states' first: the digits arms' cache serves
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    store = torch.load(path, weights_only=False) if path.exists() else {
        "prompt": PROMPT, "base": str(base), "keys": [], "z": [], "rating": [], "seconds": 0.0}
    if len(store["keys"]) >= texts:
        return store
    answers = answers or "states" in store  # a cache of answer states grows as one, whoever resumes it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.padding_side = "left"  # the last position is every row's prompt end; RoPE sees relative positions only
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if answers:
        tree = digits.answer_tree(tokenizer, PROMPT.format(text=""))
        store.setdefault("tree", dataclasses.asdict(tree))
        store.setdefault("rows", digits.output_rows(model, tree))
        store.setdefault("states", torch.empty(0, len(tree.nodes), model.config.hidden_size))
        store.setdefault("rest_lse", torch.empty(0, len(tree.nodes)))
    todo = [rows[i] for i in order[len(store["keys"]) : texts]]
    path.parent.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(todo), batch_size * 4):
        # sort a window by length so a batch pads little; the store keeps the permutation's order
        window = todo[start : start + batch_size * 4]
        prompts = [PROMPT.format(text=r["text"]) for r in window]
        lengths = [len(tokenizer(p).input_ids) for p in prompts]
        by_length = sorted(range(len(window)), key=lengths.__getitem__)
        z = torch.empty(len(window), model.config.hidden_size)
        if answers:
            states = torch.empty(len(window), len(tree.nodes), model.config.hidden_size)
            rest_lse = torch.empty(len(window), len(tree.nodes))
        began = time.perf_counter()
        with torch.inference_mode():
            for b in range(0, len(window), batch_size):
                idx = by_length[b : b + batch_size]
                enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True)
                if answers:
                    out = digits.answer_states(model, tree, enc.input_ids, enc.attention_mask, tokenizer.pad_token_id)
                    states[idx], rest_lse[idx] = out["states"], out["rest_lse"]
                    z[idx] = out["states"][:, 0]
                else:
                    z[idx] = model.get_decoder()(**enc).last_hidden_state[:, -1].float()
        store["seconds"] += time.perf_counter() - began
        store["keys"] += [f"{r['source']}:{r['id']}" for r in window]
        store["rating"] += [r["rating"] for r in window]
        store["z"] = torch.cat([torch.as_tensor(store["z"]).reshape(-1, z.shape[1]), z])
        if answers:
            store["states"] = torch.cat([store["states"], states])
            store["rest_lse"] = torch.cat([store["rest_lse"], rest_lse])
        tmp = path.with_suffix(".tmp")
        torch.save(store, tmp)
        os.replace(tmp, path)
        print(f"  extracted {len(store['keys'])}/{texts} texts, {store['seconds'] / len(store['keys']):.2f} s/text",
              flush=True)
    return store


def answer_features(store: dict, texts: int) -> "digits.AnswerFeatures":
    """The digits arm's inputs from a store extracted with `answers`."""
    return digits.AnswerFeatures(store["states"][:texts], store["rest_lse"][:texts], store["rows"],
                                 digits.AnswerTree(**store["tree"]))


# --- predictive laws: quantiles and metrics ---------------------------------------------------------------------


def standard_quantile(family: str, p: float, df: float | None = None) -> float:
    """The p-quantile of the standard law (location 0, scale 1) of `family`, in float64."""
    if not 0 < p < 1:
        raise ValueError(f"a quantile level must lie in (0, 1), got {p}")
    if family == "cauchy":
        return math.tan(math.pi * (p - 0.5))
    if family == "gaussian":
        return math.sqrt(2.0) * torch.special.erfinv(torch.tensor(2 * p - 1, dtype=torch.float64)).item()
    if family == "student_t":
        return student_t_quantile(p, df)
    raise ValueError(f"unknown family {family!r}: choose cauchy, gaussian or student_t")


def student_t_quantile(p: float, df: float, points: int = 4001) -> float:
    """Quantile of Student's t with `df` degrees of freedom (no closed form for a general ν, no scipy here)."""
    if not df > 0:
        raise ValueError(f"Student-t degrees of freedom must be > 0, got {df}")
    return student_t_quantiles(torch.tensor([p], dtype=torch.float64), df, points).item()


def student_t_quantiles(p: torch.Tensor, df: float, points: int = 201) -> torch.Tensor:
    """The quantile at each level p: θ with √ν·tan θ the quantile, found by bisection on the CDF's integral
    (`student_t_half_mass`) for |p − ½| and signed after (exactly 0 at p = ½), float64."""
    target = (p.double() - 0.5).abs()
    lo, hi = torch.zeros_like(target), torch.full_like(target, math.pi / 2)
    for _ in range(60):
        mid = (lo + hi) / 2
        below = student_t_half_mass(mid, df, points) < target
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return torch.sign(p.double() - 0.5) * math.sqrt(df) * torch.tan((lo + hi) / 2)


def student_t_half_mass(theta: torch.Tensor, df: float, points: int = 4001) -> torch.Tensor:
    """P(0 < T < √ν·tan θ) for each θ in (−π/2, π/2) (negative where θ is): with t = √ν·tan θ the CDF is
    ½ + c_ν ∫₀^θ cos^(ν−1) φ dφ, c_ν = Γ((ν+1)/2) / (√π Γ(ν/2)), a bounded integrand on a finite range for ν ≥ 1,
    integrated by Simpson's rule (`points` odd), float64."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    theta = theta.double()
    phi = theta[..., None] * torch.linspace(0.0, 1.0, points, dtype=torch.float64)
    f = torch.cos(phi) ** (df - 1)
    simpson = f[..., 0] + f[..., -1] + 4 * f[..., 1:-1:2].sum(-1) + 2 * f[..., 2:-1:2].sum(-1)
    return c * theta / (points - 1) / 3 * simpson


def standard_cdf(family: str, x: torch.Tensor, df: float | None = None) -> torch.Tensor:
    """The CDF of the Gaussian or Student-t standard law at each x, float64 (the Cauchy law's truncated quantiles are
    the package's, `cauchy_quantile`)."""
    x = x.double()
    if family == "gaussian":
        return torch.special.ndtr(x)
    if family == "student_t":
        return 0.5 + student_t_half_mass(torch.atan(x / math.sqrt(df)), df, points=201)
    raise ValueError(f"unknown family {family!r}: choose gaussian or student_t")


def standard_quantiles(family: str, p: torch.Tensor, df: float | None = None) -> torch.Tensor:
    """The quantile of the Gaussian or Student-t standard law at each level p in (0, 1), float64."""
    p = p.double()
    if family == "gaussian":
        return torch.special.ndtri(p)
    if family == "student_t":
        return student_t_quantiles(p, df)
    raise ValueError(f"unknown family {family!r}: choose gaussian or student_t")


def truncated_quantile(family: str, loc: torch.Tensor, scale: torch.Tensor, p: float, support: tuple[float, float],
                       df: float | None = None) -> torch.Tensor:
    """The p-quantile of loc + scale·X given that it lies in `support` = (low, high), X `family`'s standard law:
    loc + scale·F⁻¹(F(a) + p·(F(b) − F(a))) with a, b the standardised ends. The law a head would give if told the
    target's range, as the digits LM's answers know it. A row whose law puts no float64 mass on the range gets the
    nearer end. The Cauchy law's is the package's reading (`causalqwen_adapter.cauchy.cauchy_quantile`)."""
    loc, scale = loc.double(), scale.double()
    if family == "cauchy":
        from causalqwen_adapter.cauchy import cauchy_quantile

        return cauchy_quantile(loc, scale, p, support)
    low, high = support
    f_low = standard_cdf(family, (low - loc) / scale, df)
    f_high = standard_cdf(family, (high - loc) / scale, df)
    inside = f_high > f_low
    level = torch.where(inside, f_low + p * (f_high - f_low), torch.full_like(loc, 0.5)).clamp(1e-300, 1 - 1e-16)
    value = loc + scale * standard_quantiles(family, level, df)
    nearer = torch.where(loc < low, torch.full_like(loc, low), torch.full_like(loc, high))
    return torch.where(inside, value, nearer).clamp(low, high)


def central_interval(family: str, loc: torch.Tensor, scale: torch.Tensor, level: float, df: float | None = None):
    """(lower, upper) of the central `level` interval of loc + scale·X, X the standard law: its (1 ∓ level)/2
    quantiles."""
    q = standard_quantile(family, (1 + level) / 2, df)
    loc, scale = loc.double(), scale.double()
    return loc - scale * q, loc + scale * q


def coverage(lower: torch.Tensor, upper: torch.Tensor, y: torch.Tensor) -> float:
    """Share of targets inside [lower, upper]."""
    y = y.double()
    return ((lower <= y) & (y <= upper)).double().mean().item()


def mean_width(lower: torch.Tensor, upper: torch.Tensor) -> float:
    return (upper.double() - lower.double()).mean().item()


def interval_score(lower: torch.Tensor, upper: torch.Tensor, y: torch.Tensor, level: float) -> float:
    """Mean Winkler score of central `level` intervals: width + (2/α)·distance outside, α = 1 − level (lower is better;
    a proper score for the (α/2, 1 − α/2) quantiles)."""
    alpha = 1 - level
    lower, upper, y = lower.double(), upper.double(), y.double()
    below = (lower - y).clamp_min(0)
    above = (y - upper).clamp_min(0)
    return (upper - lower + 2 / alpha * (below + above)).mean().item()


def conformal_offset(lower: torch.Tensor, upper: torch.Tensor, y: torch.Tensor, level: float) -> float:
    """Split-conformal offset of central `level` intervals (conformalized quantile regression, Romano, Patterson and
    Candès 2019): the ⌈(n + 1)·level⌉-th smallest of max(lower − y, y − upper) over n calibration rows, inf where
    that rank exceeds n. Widening every interval by it (narrowing, when negative) covers a new exchangeable row with
    probability ≥ level, whatever the head's law."""
    conformity = torch.maximum(lower.double() - y.double(), y.double() - upper.double())
    rank = math.ceil((len(y) + 1) * level)
    return math.inf if rank > len(y) else conformity.sort().values[rank - 1].item()


def widen(lower: torch.Tensor, upper: torch.Tensor, offset: float):
    """[lower − offset, upper + offset], a negative offset stopping at the interval's midpoint (never inverted)."""
    lower, upper = lower.double(), upper.double()
    middle = (lower + upper) / 2
    return torch.minimum(lower - offset, middle), torch.maximum(upper + offset, middle)


def calibrated_intervals(validation: dict, y_validation: torch.Tensor, test: dict) -> dict:
    """Each level's test intervals widened by the conformal offset of the same head's validation intervals."""
    return {level: widen(*test[level], conformal_offset(*validation[level], y_validation, level)) for level in test}


def median_absolute_error(median: torch.Tensor, y: torch.Tensor) -> float:
    return (median.double() - y.double()).abs().median().item()


def mean_and_standard_error(values) -> tuple[float, float]:
    values = [float(v) for v in values]
    if len(values) < 2 or not all(map(math.isfinite, values)):  # an infinite score (no finite conformal offset on
        return statistics.fmean(values), float("nan")  # a small validation set) has no spread; stdev would raise
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


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
CONDITIONS = {
    "clean": "clean training targets (test targets clean)",
    "shuffled": "shuffled training and validation targets (test targets clean)",
    "shuffled_test": "shuffled targets everywhere: the same heads as above, scored on test targets shuffled alike",
}


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


def interval_metrics(intervals: dict, y, prefix: str = "") -> dict:
    """Coverage, mean width and Winkler score of each level's (lower, upper); `score`, their mean Winkler score, is
    what the learning rate is picked by."""
    out = {}
    for level, (lower, upper) in intervals.items():
        out[f"{prefix}coverage_{level}"] = coverage(lower, upper, y)
        out[f"{prefix}width_{level}"] = mean_width(lower, upper)
        out[f"{prefix}winkler_{level}"] = interval_score(lower, upper, y, level)
    out[f"{prefix}score"] = statistics.fmean(out[f"{prefix}winkler_{level}"] for level in intervals)
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


# --- protocol ---------------------------------------------------------------------------------------------------


def split_and_corrupt(n: int, seed: int, fraction: float, train_share=0.6, validation_share=0.2):
    """(train, validation, test) indices of a seeded split, and for the shuffled conditions a permutation of each
    part's targets: `fraction` of the part's rows, chosen at random, each get the target of another chosen row (a
    cycle, so no chosen row keeps its own)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g)
    n_train, n_val = int(n * train_share), int(n * validation_share)
    parts = order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]
    shuffles = []
    for part in parts:
        chosen = torch.randperm(len(part), generator=g)[: round(fraction * len(part))]
        mapping = torch.arange(len(part))
        mapping[chosen] = chosen.roll(1)
        shuffles.append(mapping)
    return parts, shuffles


def run_protocol(z, ratings, *, seeds, steps, batch_size, learning_rates, fraction, arms, select="score",
                 answers=None, log=print) -> list[dict]:
    """One row per (seed, condition, arm): the test metrics at the learning rate whose validation `select` ("score",
    the mean Winkler score, or "nll") is lowest; `candidates` keeps every rate's validation and test metrics, so
    another rule can be applied to the JSON afterwards. The digits arms read `answers` (evidence_digits'
    AnswerFeatures of the same texts) instead of z. The heads trained on shuffled targets are scored twice: on clean
    test targets ("shuffled") and on test targets shuffled alike ("shuffled_test")."""
    if any(arm in DIGIT_ARMS for arm in arms) and (answers is None or len(answers) != len(ratings)):
        raise ValueError("the digits arms need the answer states of the same texts: extract them with answers=True")
    results = []
    for seed in range(seeds):
        (train, val, test), (shuffle_train, shuffle_val, shuffle_test) = split_and_corrupt(len(ratings), seed, fraction)
        tests = {"clean": {"clean": ratings[test]},
                 "shuffled": {"shuffled": ratings[test], "shuffled_test": ratings[test][shuffle_test]}}
        for training, y_tests in tests.items():
            y_train, y_val = ratings[train], ratings[val]
            if training == "shuffled":
                y_train, y_val = y_train[shuffle_train], y_val[shuffle_val]
            for condition, y_test in y_tests.items():
                results.append({"seed": seed, "condition": condition, "arm": "constant",
                                **score_constant(y_train, y_test, y_val)})
            for arm in arms:
                x = answers if arm in DIGIT_ARMS else z
                candidates = []
                for lr in learning_rates if arm != "digits_zero_shot" else [0.0]:
                    head = train_head(arm, x[train], y_train, lr=lr, steps=steps, batch_size=batch_size, seed=seed)
                    candidates.append({"lr": lr, "validation": score_head(head, x[val], y_val),
                                       **{condition: score_head(head, x[test], y, (x[val], y_val))
                                          for condition, y in y_tests.items()}})
                best = min(candidates, key=lambda c: c["validation"].get(select, float("inf")))
                for condition in y_tests:
                    row = {"seed": seed, "condition": condition, "arm": arm, "lr": best["lr"],
                           "validation_" + select: best["validation"].get(select, float("inf")), **best[condition],
                           "candidates": [{"lr": c["lr"], "validation": c["validation"], "test": c[condition]}
                                          for c in candidates]}
                    results.append(row)
                    log(f"  seed {seed} {condition:>13} {arm:>16}: lr {row['lr']:g}, test MedAE "
                        f"{row.get('median_abs_error', float('nan')):.3f}, 90% coverage "
                        f"{row.get('coverage_0.9', float('nan')):.3f}, mean Winkler {row['score']:.3f}")
    return results


def reselect(results: list[dict], select: str) -> list[dict]:
    """The rows as if `select` had picked each arm's learning rate: every rate's validation and test metrics are kept
    in a row's `candidates`, so no head is retrained."""
    out = []
    for row in results:
        if "candidates" not in row:  # the constant predictor: nothing to pick
            out.append(row)
            continue
        best = min(row["candidates"], key=lambda c: c["validation"].get(select, float("inf")))
        kept = {k: row[k] for k in ("seed", "condition", "arm", "candidates")}
        out.append({**kept, "lr": best["lr"], "validation_" + select: best["validation"].get(select, float("inf")),
                    **best["test"]})
    return out


PROTOCOL_KEYS = ("texts", "seeds", "steps", "batch_size", "learning_rates", "shuffle_fraction", "prompt")


def merge_runs(saved: list[dict]) -> tuple[dict, list[dict]]:
    """(meta, runs) of several JSON files this script wrote for the same protocol (texts, seeds, steps, rates, ...:
    the same splits and shuffles), as one run of all their arms: an arm run later pairs with the arms run before.
    The constant predictor's rows, which every file has, are taken once. Refuses files of different protocols, and an
    arm in two files."""
    meta = saved[0]["meta"]
    for other in saved[1:]:
        differ = [key for key in PROTOCOL_KEYS if other["meta"].get(key) != meta.get(key)]
        if differ:
            raise ValueError(f"these runs are not of the same protocol ({', '.join(differ)} differ: "
                             f"{[other['meta'].get(k) for k in differ]} against {[meta.get(k) for k in differ]}): "
                             "only runs with the same splits pair")
    runs, owner = [], {}
    for index, file in enumerate(saved):
        for row in file["runs"]:
            if row["arm"] == "constant" and index > 0:
                continue
            if owner.setdefault(row["arm"], index) != index:
                raise ValueError(f"arm {row['arm']!r} ran in two of these files: keep one of them")
            runs.append(row)
    return meta, runs


INTERVAL_METRICS = [f"{m}_{lv}" for m in ("coverage", "width", "winkler") for lv in LEVELS]
CALIBRATED_METRICS = INTERVAL_METRICS + ["calibrated_" + m for m in INTERVAL_METRICS]
METRICS = (["median_abs_error", "nll"] + CALIBRATED_METRICS + ["truncated_median_abs_error"]
           + ["truncated_" + m for m in CALIBRATED_METRICS])


def summarize(results: list[dict]) -> list[dict]:
    """Mean ± standard error over seeds for each (condition, arm)."""
    summary = []
    for condition in (c for c in CONDITIONS if any(r["condition"] == c for r in results)):
        for arm in dict.fromkeys(r["arm"] for r in results):
            rows = [r for r in results if r["condition"] == condition and r["arm"] == arm]
            entry = {"condition": condition, "arm": arm, "seeds": len(rows),
                     "diverged": sum(bool(r.get("diverged")) for r in rows)}
            finite = [r for r in rows if not r.get("diverged")]
            for metric in METRICS + ["df"]:
                values = [r[metric] for r in finite if metric in r]
                if values:
                    entry[metric] = mean_and_standard_error(values)
            entry["lr"] = sorted(r["lr"] for r in rows if "lr" in r)
            summary.append(entry)
    return summary


PAIRED_METRICS = (["median_abs_error"] + [f"winkler_{lv}" for lv in LEVELS]
                  + [f"calibrated_winkler_{lv}" for lv in LEVELS])
TRUNCATED_PAIRED_METRICS = ["truncated_" + m for m in PAIRED_METRICS]


def paired_differences(results: list[dict], reference: str = "cauchy") -> list[dict]:
    """Mean ± standard error over seeds of (arm − `reference`) on the same split, per condition: the seeds share
    their test set across arms, so the paired difference is the sharper comparison. Seeds where either diverged are
    left out."""
    by_key = {(r["seed"], r["condition"], r["arm"]): r for r in results}
    out = []
    for condition in (c for c in CONDITIONS if any(r["condition"] == c for r in results)):
        for arm in dict.fromkeys(r["arm"] for r in results):
            if arm == reference:
                continue
            entry = {"condition": condition, "arm": arm, "reference": reference}
            for metric in PAIRED_METRICS + TRUNCATED_PAIRED_METRICS:
                diffs = [by_key[s, condition, arm][metric] - by_key[s, condition, reference][metric]
                         for s in sorted({r["seed"] for r in results})
                         if metric in by_key.get((s, condition, arm), {})
                         and metric in by_key.get((s, condition, reference), {})]
                if diffs:
                    entry[metric] = mean_and_standard_error(diffs)
            out.append(entry)
    return out


def all_paired_differences(results: list[dict]) -> list[dict]:
    """Paired differences against the package's head, and against the digits LM when it ran (the strongest
    baseline)."""
    references = [arm for arm in ("cauchy", "digits") if any(r["arm"] == arm for r in results)]
    return [entry for reference in references for entry in paired_differences(results, reference)]


def markdown(summary: list[dict], paired: list[dict] = ()) -> str:
    def cell(entry, metric, digits=3):
        if metric not in entry:
            return "–"
        mean, se = entry[metric]
        return f"{mean:.{digits}f} ± {se:.{digits}f}"

    lines = []
    for condition in dict.fromkeys(e["condition"] for e in summary):
        lines += [f"\n**{CONDITIONS[condition]}**\n",
                  "| arm | MedAE | NLL | " + " | ".join(f"cov {lv:.0%}" for lv in LEVELS) + " | "
                  + " | ".join(f"width {lv:.0%}" for lv in LEVELS) + " | "
                  + " | ".join(f"Winkler {lv:.0%}" for lv in LEVELS) + " | ν | lr picked |",
                  "|---" * (3 + 3 * len(LEVELS) + 2) + "|"]
        for entry in (e for e in summary if e["condition"] == condition):
            cells = [cell(entry, m) for m in ["median_abs_error", "nll"]]
            cells += [cell(entry, f"{m}_{lv}") for m in ("coverage", "width", "winkler") for lv in LEVELS]
            cells += [cell(entry, "df", 2), ", ".join(f"{lr:g}" for lr in entry["lr"]) or "–"]
            diverged = f" ({entry['diverged']} diverged)" if entry["diverged"] else ""
            lines.append(f"| {entry['arm']}{diverged} | " + " | ".join(cells) + " |")
        calibrated = [e for e in summary if e["condition"] == condition and "calibrated_winkler_0.5" in e]
        if calibrated:
            lines += ["\nThe same heads' intervals calibrated on the validation rows (split-conformal offset per level)\n",
                      "| arm | " + " | ".join(f"cov {lv:.0%}" for lv in LEVELS) + " | "
                      + " | ".join(f"width {lv:.0%}" for lv in LEVELS) + " | "
                      + " | ".join(f"Winkler {lv:.0%}" for lv in LEVELS) + " |",
                      "|---" * (1 + 3 * len(LEVELS)) + "|"]
            lines += [f"| {e['arm']} | " + " | ".join(cell(e, "calibrated_" + m) for m in INTERVAL_METRICS) + " |"
                      for e in calibrated]
        truncated = [e for e in summary if e["condition"] == condition and "truncated_winkler_0.5" in e]
        if truncated:
            lines += ["\nThe same heads' laws restricted to the digits LM's range (SUPPORT: a location-scale law "
                      "truncated there), as they are and calibrated\n",
                      "| arm | MedAE | " + " | ".join(f"cov {lv:.0%}" for lv in LEVELS) + " | "
                      + " | ".join(f"Winkler {lv:.0%}" for lv in LEVELS) + " | "
                      + " | ".join(f"Winkler {lv:.0%} calibrated" for lv in LEVELS) + " |",
                      "|---" * (2 + 3 * len(LEVELS)) + "|"]
            metrics = (["truncated_median_abs_error"] + [f"truncated_coverage_{lv}" for lv in LEVELS]
                       + [f"truncated_winkler_{lv}" for lv in LEVELS]
                       + [f"truncated_calibrated_winkler_{lv}" for lv in LEVELS])
            lines += [f"| {e['arm']} | " + " | ".join(cell(e, m) for m in metrics) + " |" for e in truncated]
        for reference in dict.fromkeys(e["reference"] for e in paired):
            rows = [e for e in paired if e["condition"] == condition and e["reference"] == reference]
            if not rows:
                continue
            for title, metrics in (("", PAIRED_METRICS), (", laws restricted to the range", TRUNCATED_PAIRED_METRICS)):
                if not any(metrics[0] in e for e in rows):
                    continue
                lines += [f"\nPaired over seeds, arm − {reference}{title} (negative: the arm is better)\n",
                          "| arm | ΔMedAE | " + " | ".join(f"ΔWinkler {lv:.0%}" for lv in LEVELS) + " | "
                          + " | ".join(f"ΔWinkler {lv:.0%} calibrated" for lv in LEVELS) + " |",
                          "|---" * (2 + 2 * len(LEVELS)) + "|"]
                lines += [f"| {e['arm']} | " + " | ".join(cell(e, m) for m in metrics) + " |" for e in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--data", default="/work/data/vaderSentiment-3.3.2.tar.gz", help="the vaderSentiment sdist")
    parser.add_argument("--cache", default="/work/data/evidence-numbers", help="where the extracted z are cached")
    parser.add_argument("--texts", type=int, default=768, help="rows of a fixed permutation of the 23,703 to use")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2])
    parser.add_argument("--shuffle-fraction", type=float, default=0.2)
    parser.add_argument("--select", choices=("score", "nll"), default="score",
                        help="the validation metric that picks each arm's learning rate: mean Winkler score, or NLL")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--quick", action="store_true",
                        help="a subset under 10 minutes: 200 texts, 3 seeds, 200 steps, rates 3e-4 and 3e-3")
    parser.add_argument("--output", default="bench/results/evidence_numbers", help="writes OUTPUT.json and OUTPUT.md")
    parser.add_argument("--summarize", metavar="JSON", nargs="+",
                        help="only re-render OUTPUT.md from JSON files this script wrote (with --select: re-picked); "
                             "several: runs of other arms on the same protocol, summarised and paired as one run")
    args = parser.parse_args()
    if args.summarize:
        saved = [json.loads(Path(path).read_text()) for path in args.summarize]
        try:
            meta, runs = merge_runs(saved)
        except ValueError as err:
            parser.error(str(err))
        results = reselect(runs, args.select)
        table = markdown(summarize(results), all_paired_differences(results))
        header = "\n".join(f"{m['command']}  ({m['date']}, {m['machine']}"
                           + (f"; learning rates re-picked by validation {args.select}" if args.select != m["select"]
                              else "") + ")" for m in (file["meta"] for file in saved))
        Path(f"{args.output}.md").write_text(f"{header}\n{table}")
        print(table)
        return
    if args.quick:
        args.texts, args.seeds, args.steps, args.learning_rates = 200, 3, 200, [3e-4, 3e-3]
    torch.set_num_threads(1)

    rows = read_vader_ratings(args.data)
    with_answers = any(arm in DIGIT_ARMS for arm in args.arms)
    store = extract_features(args.base, rows, args.texts, Path(args.cache), answers=with_answers)
    z = torch.as_tensor(store["z"])[: args.texts].float()
    answers = answer_features(store, args.texts) if with_answers else None
    ratings = torch.tensor(store["rating"][: args.texts], dtype=torch.float32)
    print(f"{len(ratings)} of {len(rows)} texts, z {tuple(z.shape)} ({store['seconds'] / len(store['keys']):.2f} s/text "
          "to extract)")
    began = time.perf_counter()
    results = run_protocol(z, ratings, seeds=args.seeds, steps=args.steps, batch_size=args.batch_size,
                           learning_rates=args.learning_rates, fraction=args.shuffle_fraction, arms=args.arms,
                           select=args.select, answers=answers)
    summary = summarize(results)
    paired = all_paired_differences(results)
    table = markdown(summary, paired)
    meta = {"command": "python bench/evidence_numbers.py " + " ".join(sys.argv[1:]), "texts": len(ratings),
            "seeds": args.seeds, "steps": args.steps, "batch_size": args.batch_size,
            "learning_rates": args.learning_rates, "shuffle_fraction": args.shuffle_fraction, "select": args.select,
            "prompt": PROMPT, "base": str(args.base), "arms": args.arms,
            "cauchy_head": {k: getattr(PackageCauchyHead.config(), k) for k in ("gamma_init", "b_noise_init")},
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 thread",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "protocol_seconds": round(time.perf_counter() - began, 1),
            "extract_seconds_per_text": store["seconds"] / len(store["keys"])}
    Path(f"{args.output}.json").write_text(json.dumps({"meta": meta, "summary": summary, "paired": paired,
                                                                "runs": results}, indent=1))
    Path(f"{args.output}.md").write_text(f"{meta['command']}  ({meta['date']}, {meta['machine']})\n{table}")
    print(table)


if __name__ == "__main__":
    main()
