"""The softmax LM writing the rating as digits: the baseline a user gets without any regression head.

The frozen base reads the prompt and writes the rating with one decimal (" -1.5", " 2.0": its own tokens, digit by
digit); what trains is the output layer's rows of the answer's tokens, by the cross-entropy of the SFT recipe on the
completion, from the base's own rows. Every other row stays the base's, so its logits enter each softmax as one fixed
log-sum-exp per position, and the model is exactly the full-vocabulary softmax LM with those rows trained.

Because the base is frozen, the hidden state before each answer token depends only on the prompt and the answer's
prefix, not on what trains: every prefix of every answer (a tree of about twenty states) is computed once per text,
and the model's probability of each of the 81 answers −4.0 … 4.0 is exact, a product of softmax probabilities along
the answer's path (no sampling). Decoding is constrained to those answers (their probabilities renormalised; the stop
token after the decimal is left out of both training and decoding), and the predictive law on the real line is the
histogram that spreads each answer's probability uniformly over its 0.1-wide bin: its median, central intervals
(exact quantiles of that histogram) and density (probability / 0.1) are scored like the regression heads'.
"""

from dataclasses import dataclass

import torch

GRID = tuple(k / 10 for k in range(-40, 41))  # the ratings the LM may write: −4.0 … 4.0 in steps of 0.1


def answer_text(value: float) -> str:
    """The completion that writes `value`: a space, then one decimal ("0.0", never "-0.0")."""
    text = f"{value:.1f}"
    return " " + ("0.0" if text == "-0.0" else text)


@dataclass
class AnswerTree:
    """Every answer's tokens and the states they are read from.

    `nodes` are the proper prefixes of the answers (nodes[0] is the empty one: the prompt's last state); `tokens` the
    vocabulary rows any answer uses; `continuations` the token sequences fed after the prompt so that every node is a
    prefix of one; `where[i]` the (continuation, position) whose state is node i's ((-1, -1): the prompt's end);
    `grid` the values the answers write, in order (evenly spaced)."""

    sequences: list[list[int]]
    nodes: list[tuple[int, ...]]
    tokens: list[int]
    continuations: list[list[int]]
    where: list[tuple[int, int]]
    grid: tuple[float, ...] = GRID

    def paths(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(node index, index into `tokens`, mask), each [answers, longest answer]: answer g's t-th token is read at
        node `node[g, t]` as column `token[g, t]`."""
        index = {node: i for i, node in enumerate(self.nodes)}
        column = {token: j for j, token in enumerate(self.tokens)}
        longest = max(map(len, self.sequences))
        node = torch.zeros(len(self.sequences), longest, dtype=torch.long)
        token = torch.zeros_like(node)
        mask = torch.zeros(node.shape, dtype=torch.bool)
        for g, sequence in enumerate(self.sequences):
            for t, tok in enumerate(sequence):
                node[g, t], token[g, t], mask[g, t] = index[tuple(sequence[:t])], column[tok], True
        return node, token, mask


def answer_tree(tokenizer, prompt: str, grid=GRID) -> AnswerTree:
    """The tree of the answers to `prompt` (a prompt of the task; only its end matters) as the tokenizer writes them
    after it. Refused: an answer whose first token merges with the prompt's end (the answer's tokens would then depend
    on the text), or one answer that is a prefix of another (where to stop would be a decision the tree cannot
    score)."""
    prompt_ids = tokenizer(prompt).input_ids
    sequences = []
    for value in grid:
        ids = tokenizer(prompt + answer_text(value)).input_ids
        if ids[: len(prompt_ids)] != prompt_ids or len(ids) == len(prompt_ids):
            raise ValueError(f"the answer {answer_text(value)!r} merges with the prompt's last token: end the prompt "
                             "with a character that does not join the answer's first (a colon, a newline)")
        sequences.append(ids[len(prompt_ids) :])
    nodes = sorted({tuple(s[:t]) for s in sequences for t in range(len(s))}, key=lambda p: (len(p), p))
    for value, sequence in zip(grid, sequences):
        if tuple(sequence) in nodes:
            raise ValueError(f"the answer {answer_text(value)!r} is a prefix of another answer: write every answer "
                             "with the same number of decimals")
    continuations = [list(n) for n in nodes if n and not any(len(m) > len(n) and m[: len(n)] == n for m in nodes)]
    where = [(-1, -1)]
    for node in nodes[1:]:
        c = next(i for i, cont in enumerate(continuations) if tuple(cont[: len(node)]) == node)
        where.append((c, len(node) - 1))
    tokens = sorted({t for s in sequences for t in s})
    return AnswerTree(sequences, nodes, tokens, continuations, where, tuple(grid))


@torch.no_grad()
def answer_states(model, tree: AnswerTree, input_ids, attention_mask, pad_id: int) -> dict[str, torch.Tensor]:
    """For a batch of left-padded prompts: the state at every node ([B, nodes, H]) and the log-sum-exp of the logits
    of every row outside `tree.tokens` at it ([B, nodes]). The prompts run once; their cache is repeated for the
    continuations, which run right-padded (a state never attends to the padding after it)."""
    backbone = model.get_decoder()
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
    B, C = input_ids.shape[0], len(tree.continuations)
    longest = max(map(len, tree.continuations))
    ids = torch.full((C, longest), pad_id, dtype=torch.long)
    mask = torch.zeros(C, longest, dtype=attention_mask.dtype)
    for c, cont in enumerate(tree.continuations):
        ids[c, : len(cont)], mask[c, : len(cont)] = torch.tensor(cont), 1
    cache = out.past_key_values
    cache.batch_repeat_interleave(C)
    states = backbone(input_ids=ids.repeat(B, 1), past_key_values=cache,
                      attention_mask=torch.cat([attention_mask.repeat_interleave(C, 0), mask.repeat(B, 1)], 1),
                      ).last_hidden_state.view(B, C, longest, -1)
    h = torch.stack([out.last_hidden_state[:, -1] if c < 0 else states[:, c, t] for c, t in tree.where], 1).float()
    logits = model.get_output_embeddings()(h.to(model.dtype)).float()
    logits[..., tree.tokens] = float("-inf")
    return {"states": h, "rest_lse": logits.logsumexp(-1)}


def output_rows(model, tree: AnswerTree) -> torch.Tensor:
    """The base's output-layer rows of the answer tokens (float32): where the trained rows start."""
    layer = model.get_output_embeddings()
    if getattr(layer, "bias", None) is not None:
        raise ValueError("the base's output layer has a bias: the digits arm trains rows of a bias-free layer only")
    return layer.weight[tree.tokens].detach().float().clone()


class AnswerFeatures:
    """The cached states of a set of texts and what the digits head needs beside them; indexing selects texts."""

    def __init__(self, states, rest_lse, rows, tree: AnswerTree):
        self.states, self.rest_lse, self.rows, self.tree = states, rest_lse, rows, tree

    def __getitem__(self, index):
        return AnswerFeatures(self.states[index], self.rest_lse[index], self.rows, self.tree)

    def __len__(self):
        return len(self.states)


def bin_width(grid) -> float:
    return (grid[-1] - grid[0]) / (len(grid) - 1)


def grid_index(y: torch.Tensor, grid=GRID) -> torch.Tensor:
    """The answer a rating is written as: its nearest grid value (ratings beyond the grid: the end value)."""
    return torch.round((y.double() - grid[0]) / bin_width(grid)).long().clamp(0, len(grid) - 1)


class HistogramLaw:
    """The law that spreads probability p[g] uniformly over [grid[g] − w/2, grid[g] + w/2] (w the grid's spacing):
    quantiles and density."""

    def __init__(self, probs: torch.Tensor, grid=GRID):
        self.probs, self.grid, self.width = probs.double(), grid, bin_width(grid)
        self.left = torch.tensor(grid, dtype=torch.float64) - self.width / 2
        self.cdf = self.probs.cumsum(-1)  # at each bin's right edge

    def quantile(self, q: float) -> torch.Tensor:
        cdf = self.cdf
        g = torch.searchsorted(cdf, torch.full((len(cdf), 1), q, dtype=torch.float64)).clamp_max(cdf.shape[-1] - 1)
        below = (cdf.gather(-1, g) - self.probs.gather(-1, g)).squeeze(-1)
        inside = ((q - below) / self.probs.gather(-1, g).squeeze(-1)).clamp(0, 1)
        return self.left[g.squeeze(-1)] + self.width * inside

    def nll(self, y: torch.Tensor) -> torch.Tensor:
        return -(self.probs.gather(-1, grid_index(y, self.grid)[:, None]).squeeze(-1) / self.width).log()


class DigitsHead(torch.nn.Module):
    """The output-layer rows of the answer's tokens (trained), the rest of the vocabulary as its fixed log-sum-exp."""

    family = "digits"

    def __init__(self, features: AnswerFeatures, train: bool = True):
        super().__init__()
        self.rows = torch.nn.Parameter(features.rows.clone(), requires_grad=train)
        self.grid = features.tree.grid
        node, token, mask = features.tree.paths()
        self.register_buffer("node", node)
        self.register_buffer("token", token)
        self.register_buffer("mask", mask)

    def token_log_probs(self, x: AnswerFeatures) -> torch.Tensor:
        """log p(answer g's t-th token | its prefix), [texts, answers, longest]; 0 where the answer has ended."""
        logits = torch.cat([x.states @ self.rows.T, x.rest_lse[..., None]], -1)  # [texts, nodes, tokens + 1]
        logp = logits.log_softmax(-1)[:, self.node, self.token]
        return logp.masked_fill(~self.mask, 0.0)

    def training_loss(self, x: AnswerFeatures, y: torch.Tensor) -> torch.Tensor:
        """The SFT cross-entropy of each text's answer, per token (over the full vocabulary, nothing constrained)."""
        g = grid_index(y, self.grid)
        return -self.token_log_probs(x)[torch.arange(len(g)), g].sum(-1) / self.mask[g].sum(-1)

    def distribution(self, x: AnswerFeatures) -> HistogramLaw:
        """The law of the rating the LM writes: its answers' probabilities, renormalised over the answers."""
        return HistogramLaw(self.token_log_probs(x).sum(-1).double().softmax(-1), self.grid)

    def nll(self, x: AnswerFeatures, y: torch.Tensor) -> torch.Tensor:
        return self.distribution(x).nll(y)

    def predict(self, x: AnswerFeatures, levels) -> tuple[torch.Tensor, dict]:
        law = self.distribution(x)
        return law.quantile(0.5), {lv: (law.quantile((1 - lv) / 2), law.quantile((1 + lv) / 2)) for lv in levels}
