"""bench/evidence_digits.py (the softmax LM writing the rating as digits): the answer tree against its definition, the
states against one unpadded forward of prompt + answer, the head's probabilities against a full-vocabulary softmax,
and the histogram law's quantiles and density against float64 loops."""

import importlib.util
import string
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
SPEC = importlib.util.spec_from_file_location("evidence_digits", BENCH / "evidence_digits.py")
digits = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(digits)
NUMBERS_SPEC = importlib.util.spec_from_file_location("evidence_numbers_for_digits", BENCH / "evidence_numbers.py")
numbers = importlib.util.module_from_spec(NUMBERS_SPEC)
NUMBERS_SPEC.loader.exec_module(numbers)


class CharTokenizer:
    """One id per character (what the tree must handle when every character is a token); `merge` joins ': ' into one
    token, as a BPE that merges the prompt's end with the answer's space would."""

    def __init__(self, merge=False):
        self.merge = merge

    def __call__(self, text):
        ids, i = [], 0
        while i < len(text):
            if self.merge and text[i : i + 2] == ": ":
                ids.append(1000)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return type("Encoding", (), {"input_ids": ids})()


def test_answer_text_writes_one_decimal_and_no_negative_zero():
    assert [digits.answer_text(v) for v in (-4.0, -0.04, 0.0, 0.25, 3.9)] == [" -4.0", " 0.0", " 0.0", " 0.2", " 3.9"]
    assert len(digits.GRID) == 81 and digits.GRID[0] == -4.0 and digits.GRID[-1] == 4.0


def test_tree_nodes_are_every_proper_prefix_and_each_is_found_in_a_continuation():
    tree = digits.answer_tree(CharTokenizer(), "rate:")
    answers = [[ord(c) for c in digits.answer_text(v)] for v in digits.GRID]
    assert tree.sequences == answers
    assert set(tree.nodes) == {tuple(a[:t]) for a in answers for t in range(len(a))} and tree.nodes[0] == ()
    assert tree.tokens == sorted({t for a in answers for t in a})
    for node, (c, t) in zip(tree.nodes, tree.where):
        assert (c, t) == (-1, -1) if not node else tuple(tree.continuations[c][: t + 1]) == node
    for cont in tree.continuations:  # maximal: no node extends a continuation
        assert not any(len(n) > len(cont) and list(n[: len(cont)]) == cont for n in tree.nodes)
    node, token, mask = tree.paths()
    for g, answer in enumerate(answers):
        assert mask[g].sum() == len(answer)
        for t, tok in enumerate(answer):
            assert tree.nodes[node[g, t]] == tuple(answer[:t]) and tree.tokens[token[g, t]] == tok


def test_tree_refuses_an_answer_merged_with_the_prompt_or_a_prefix_answer():
    with pytest.raises(ValueError, match="merges with the prompt's last token"):
        digits.answer_tree(CharTokenizer(merge=True), "rate:")

    class Truncating(CharTokenizer):  # writes " 1.0" as " 1" so that it is a prefix of " 1.5"
        def __call__(self, text):
            return super().__call__(text[:-2] if text.endswith(".0") else text)

    with pytest.raises(ValueError, match="' 1.0' is a prefix of another answer"):
        digits.answer_tree(Truncating(), "rate:", grid=(1.0, 1.5))


def random_features(n=6, hidden=8, vocab=40, seed=0):
    """Answer states from random vectors and a full output layer; the full layer is kept for the reference."""
    g = torch.Generator().manual_seed(seed)
    tree = digits.answer_tree(CharTokenizer(), "rate:", grid=(-1.0, -0.5, 0.0, 0.5, 1.0, 1.5))
    remap = {t: i for i, t in enumerate(tree.tokens)}  # the answer tokens are rows 0..k−1 of the small vocabulary
    tree = digits.AnswerTree([[remap[t] for t in s] for s in tree.sequences],
                             [tuple(remap[t] for t in n) for n in tree.nodes], sorted(remap.values()),
                             [[remap[t] for t in c] for c in tree.continuations], tree.where, tree.grid)
    weight = torch.randn(vocab, hidden, generator=g)
    states = torch.randn(n, len(tree.nodes), hidden, generator=g)
    logits = states @ weight.T
    rest = logits.clone()
    rest[..., tree.tokens] = float("-inf")
    return digits.AnswerFeatures(states, rest.logsumexp(-1), weight[tree.tokens].clone(), tree), weight


def test_head_token_probabilities_are_the_full_vocabulary_softmax():
    features, weight = random_features()
    head = digits.DigitsHead(features)
    with torch.no_grad():
        head.rows.add_(0.3)  # trained rows differ from the base's: the full layer's answer rows move with them
    full = weight.clone().double()
    full[features.tree.tokens] = head.rows.detach().double()
    logp = (features.states.double() @ full.T).log_softmax(-1)
    got = head.token_log_probs(features).double()
    for i in range(len(features)):
        answer_logp = []
        for g, sequence in enumerate(features.tree.sequences):
            ref = [logp[i, features.tree.nodes.index(tuple(sequence[:t])), tok].item() for t, tok in enumerate(sequence)]
            assert got[i, g, : len(sequence)].tolist() == pytest.approx(ref, abs=1e-5)
            answer_logp.append(sum(ref))
        probs = torch.tensor(answer_logp).softmax(-1)  # constrained to the answers, renormalised
        assert head.distribution(features[i : i + 1]).probs[0].tolist() == pytest.approx(probs.tolist(), abs=1e-6)
    y = torch.tensor([-1.02, 0.3, 1.49, 7.0, -3.0, 0.0])  # nearest answers, the ends beyond the grid
    assert digits.grid_index(y, grid=features.tree.grid).tolist() == [0, 3, 5, 5, 0, 2]


def test_training_loss_is_the_mean_cross_entropy_of_the_answer_tokens():
    features, weight = random_features(seed=1)
    head = digits.DigitsHead(features)
    y = torch.tensor([1.4, -0.9, 0.1, 0.6, -0.4, 1.1])  # answers 5, 0, 2, 3, 1, 4
    logp = (features.states.double() @ weight.T.double()).log_softmax(-1)
    for i, g in enumerate([5, 0, 2, 3, 1, 4]):
        sequence = features.tree.sequences[g]
        ref = -sum(logp[i, features.tree.nodes.index(tuple(sequence[:t])), tok].item() for t, tok in enumerate(sequence))
        assert head.training_loss(features[i : i + 1], y[i : i + 1]).item() == pytest.approx(ref / len(sequence),
                                                                                               rel=1e-5)


def naive_quantile(probs, q, left, width):
    acc = 0.0
    for p, lo in zip(probs, left):
        if acc + p >= q:
            return lo + width * (q - acc) / p
        acc += p
    return left[-1] + width


@pytest.mark.parametrize("q", [0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.975])
def test_histogram_quantiles_and_density_match_loops(q):
    torch.manual_seed(2)
    probs = torch.rand(5, 81).pow(3).softmax(-1).double()
    law = digits.HistogramLaw(probs)
    left = [v - 0.05 for v in digits.GRID]
    got = law.quantile(q)
    for i in range(5):
        assert got[i].item() == pytest.approx(naive_quantile(probs[i].tolist(), q, left, 0.1), abs=1e-12)
    y = torch.tensor([-3.96, -0.01, 0.04, 2.5, 3.99])
    bins = [round((v + 4) * 10) for v in (-3.96, -0.01, 0.04, 2.5, 3.99)]
    assert law.nll(y).tolist() == pytest.approx([-torch.log(probs[i, b] / 0.1).item() for i, b in enumerate(bins)])


def test_a_point_mass_gives_its_bin_as_every_interval():
    probs = torch.zeros(1, 81, dtype=torch.float64)
    probs[0, 45] = 1.0  # all on 0.5: the law is uniform on [0.45, 0.55]
    law = digits.HistogramLaw(probs)
    assert law.quantile(0.5).item() == pytest.approx(0.5) and law.quantile(0.05).item() == pytest.approx(0.455)
    assert law.quantile(0.95).item() == pytest.approx(0.545)


# --- extraction -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def char_base(tmp_path_factory):
    """A tiny Qwen2 whose tokenizer writes each character as a token (the answers' digits, '.', '-' and ' ' too)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {c: i for i, c in enumerate(["<unk>", "<pad>", "<eos>", *sorted(set(string.printable))])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=None, bos_token_id=None)
    folder = tmp_path_factory.mktemp("char-base")
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_extracted_states_are_one_unpadded_forward_of_prompt_and_answer(char_base, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [{"source": "tweets_GroundTruth.txt", "id": str(i), "rating": i / 3 - 1.5, "text": "ok! " * (1 + i % 4)}
            for i in range(7)]
    first = numbers.extract_features(str(char_base), rows, 4, tmp_path, batch_size=3, answers=True)
    assert first["states"].shape[0] == 4
    store = numbers.extract_features(str(char_base), rows, 7, tmp_path, batch_size=3)  # resumed, z alone asked
    assert store["states"].shape[0] == 7 and store["rest_lse"].shape[0] == 7
    features = numbers.answer_features(store, 7)
    tree = features.tree
    # a run of the regression arms alone reads z from this cache, and resumes it as answer states
    z_alone = numbers.extract_features(str(char_base), rows, 7, tmp_path, batch_size=3)
    torch.testing.assert_close(torch.as_tensor(z_alone["z"]), torch.as_tensor(store["z"]), rtol=0, atol=0)
    assert not numbers.feature_cache_path(tmp_path, str(char_base)).exists()
    tokenizer = AutoTokenizer.from_pretrained(char_base)
    model = AutoModelForCausalLM.from_pretrained(char_base, dtype=torch.float32).eval()
    torch.testing.assert_close(features.rows, model.lm_head.weight[tree.tokens])
    torch.testing.assert_close(torch.as_tensor(store["z"]), features.states[:, 0])
    order = torch.randperm(7, generator=torch.Generator().manual_seed(0)).tolist()
    assert store["rating"] == [rows[i]["rating"] for i in order]
    with torch.no_grad():
        for k, i in enumerate(order):
            prompt = tokenizer(numbers.PROMPT.format(text=rows[i]["text"])).input_ids
            for sequence in (tree.sequences[0], tree.sequences[47], tree.sequences[-1]):
                out = model(torch.tensor([prompt + sequence]), output_hidden_states=True)
                span = slice(len(prompt) - 1, len(prompt) - 1 + len(sequence))
                nodes = [tree.nodes.index(tuple(sequence[:t])) for t in range(len(sequence))]
                torch.testing.assert_close(features.states[k, nodes], out.hidden_states[-1][0, span],
                                           atol=1e-5, rtol=1e-5)
                rest = out.logits[0, span].clone()
                rest[:, tree.tokens] = float("-inf")
                torch.testing.assert_close(features.rest_lse[k, nodes], rest.logsumexp(-1), atol=1e-5, rtol=1e-5)


def class_features(n=90, hidden=16, seed=0):
    """Answer states of the default 81-answer tree that say which of three ratings (−2, 0, 2) a text has."""
    g = torch.Generator().manual_seed(seed)
    tree = digits.answer_tree(CharTokenizer(), "rate:")
    remap = {t: i for i, t in enumerate(tree.tokens)}
    tree = digits.AnswerTree([[remap[t] for t in s] for s in tree.sequences],
                             [tuple(remap[t] for t in n) for n in tree.nodes], sorted(remap.values()),
                             [[remap[t] for t in c] for c in tree.continuations], tree.where, tree.grid)
    label = torch.arange(n) % 3
    states = torch.randn(len(tree.nodes), hidden, generator=g) + 0.1 * torch.randn(n, len(tree.nodes), hidden,
                                                                                   generator=g)
    states[torch.arange(n), :, label] += 3.0
    features = digits.AnswerFeatures(states, torch.zeros(n, len(tree.nodes)), 0.1 * torch.randn(len(remap), hidden,
                                                                                                 generator=g), tree)
    return features, torch.tensor([-2.0, 0.0, 2.0])[label]


def test_protocol_trains_the_digits_arm_and_scores_shuffled_tests():
    features, ratings = class_features()
    z = features.states[:, 0]
    results = numbers.run_protocol(z, ratings, seeds=1, steps=60, batch_size=16, learning_rates=[1e-1],
                                   fraction=0.2, arms=["digits", "digits_zero_shot"], answers=features,
                                   log=lambda *_: None)
    by = {(r["condition"], r["arm"]): r for r in results}
    assert set(by) == {(c, a) for c in ("clean", "shuffled", "shuffled_test")
                       for a in ("constant", "digits", "digits_zero_shot")}
    assert by["clean", "digits_zero_shot"]["lr"] == 0.0
    assert by["clean", "digits"]["median_abs_error"] < 0.1 * by["clean", "constant"]["median_abs_error"]
    assert by["clean", "digits"]["nll"] < by["clean", "digits_zero_shot"]["nll"] - 1.0
    # the same heads for both shuffled conditions, scored on different test targets
    assert by["shuffled", "digits"]["validation_score"] == by["shuffled_test", "digits"]["validation_score"]
    assert by["shuffled", "digits"]["winkler_0.9"] < by["shuffled_test", "digits"]["winkler_0.9"]
    with pytest.raises(ValueError, match="answer states of the same texts"):
        numbers.run_protocol(z, ratings, seeds=1, steps=1, batch_size=4, learning_rates=[1e-2], fraction=0.2,
                             arms=["digits"], log=lambda *_: None)
