"""The plots of `causalqwen compare` (causalqwen_adapter/comparison/plots.py), drawn from a result dict alone: the
panels each metric gets, the per-seed differences and intervals they show against a direct computation, a redraw
from a saved comparison.json, and the refusal, before any work, of plots without matplotlib."""

import json
import math
import random
import statistics
import sys

import pytest
from test_compare import argv, base_folder, tokenizer_dir, write_rows  # noqa: F401 (fixtures)

from causalqwen_adapter.cli import compare
from causalqwen_adapter.comparison import plots
from causalqwen_adapter.comparison import runs as runs_module
from causalqwen_adapter.comparison.runs import NOISE_METRICS, UNKNOWN_METRICS
from causalqwen_adapter.comparison.stats import t_critical
from causalqwen_adapter.comparison.verdicts import paired_table

ARMS, SEEDS, LRS = ["ovr_candidates", "ovr_alone", "softmax"], [0, 1, 2], [1e-4, 1e-3, 1e-2]


def synthetic_results(metrics, seed=0) -> dict:
    """A result dict as compare writes it, through JSON (seeds become strings), from random per-seed metrics."""
    rng = random.Random(seed)
    per_seed = {arm: {s: {m: rng.random() for m in metrics} for s in SEEDS} for arm in ARMS}
    chosen = {arm: {s: rng.choice(LRS) for s in SEEDS} for arm in ARMS}
    table = paired_table(per_seed, "softmax", list(metrics), SEEDS)
    results = {"args": {"baseline": "softmax", "lrs": LRS}, "table": table, "alpha": 0.05, "per_seed": per_seed,
               "chosen": chosen}
    return json.loads(json.dumps(results))


def t_df2(alpha):
    """t with P(|T| ≥ t) = alpha at 2 degrees of freedom, in closed form: P(|T| ≥ t) = 1 − t / √(t² + 2)."""
    q = 1 - alpha
    return math.sqrt(2) * q / math.sqrt(1 - q * q)


def test_t_critical_matches_tables_and_the_closed_form():
    assert t_critical(0.05, 4) == pytest.approx(2.776445, abs=1e-6)  # Student's t tables
    assert t_critical(0.05, 9) == pytest.approx(2.262157, abs=1e-6)
    assert t_critical(0.01, 2) == pytest.approx(t_df2(0.01), rel=1e-10)
    with pytest.raises(ValueError, match="alpha must be in"):
        t_critical(0, 3)


@pytest.mark.parametrize("metrics", [NOISE_METRICS, NOISE_METRICS + UNKNOWN_METRICS])
def test_one_panel_per_metric_with_the_seeds_differences_and_the_adjusted_interval(metrics):
    results = synthetic_results(metrics)
    figures = plots.draw(results)
    assert list(figures) == list(plots.PLOT_FILES)
    axes = figures["comparison_differences.png"].axes
    assert [ax.get_title() for ax in axes] == [f"{m} ({'lower' if m in ('ece', 'fpr_at_95_tpr') else 'higher'} is "
                                               "better)" for m in metrics]
    m = 2 * len(metrics)  # the table's comparisons: two arms × the metrics
    half_t = t_df2(0.05 / m)
    for ax, metric in zip(axes, metrics):
        rows = {r["arm"]: r for r in results["table"] if r["metric"] == metric}
        assert [t.get_text() for t in ax.get_xticklabels()] == [f"{arm}\n{rows[arm]['verdict']}"
                                                               for arm in ("ovr_candidates", "ovr_alone")]
        for i, arm in enumerate(("ovr_candidates", "ovr_alone")):
            diffs = [results["per_seed"][arm][str(s)][metric] - results["per_seed"]["softmax"][str(s)][metric]
                     for s in SEEDS]
            assert [y for _, y in ax.collections[2 * i].get_offsets()] == pytest.approx(diffs, rel=1e-12)
            mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(3)
            d = plots.differences(results)[metric][arm]
            assert d["mean"] == pytest.approx(mean, rel=1e-12)
            assert d["half_width"] == pytest.approx(half_t * se, rel=1e-9)
            bar = ax.containers[i]  # the errorbar: its line is the mean, its caps mean ± half-width
            assert bar.lines[0].get_ydata()[0] == pytest.approx(mean, rel=1e-12)
            caps = sorted(cap.get_ydata()[0] for cap in bar.lines[1])
            assert caps == pytest.approx([mean - half_t * se, mean + half_t * se], rel=1e-9)
    rates = figures["comparison_rates.png"].axes
    assert len(rates) == 1 and rates[0].get_yscale() == "log"
    for i, arm in enumerate(ARMS):
        assert [y for _, y in rates[0].collections[i].get_offsets()] == [results["chosen"][arm][str(s)] for s in SEEDS]


def test_a_saved_comparison_is_drawn_again(tmp_path, capsys):
    (tmp_path / "comparison.json").write_text(json.dumps(synthetic_results(NOISE_METRICS)))
    written = plots.main([str(tmp_path / "comparison.json")])
    assert written == [tmp_path / name for name in plots.PLOT_FILES]
    assert all(path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG" for path in written)
    elsewhere = plots.main([str(tmp_path / "comparison.json"), "--output_dir", str(tmp_path / "new" / "plots")])
    assert elsewhere == [tmp_path / "new" / "plots" / name for name in plots.PLOT_FILES]  # the folder is made
    assert all(path.is_file() for path in elsewhere)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit) as error:
        plots.main([str(tmp_path / "other.json")])
    assert error.value.code == 2 and "has no args, table, per_seed, chosen" in capsys.readouterr().err


def test_plots_without_matplotlib_are_refused_before_any_work(base_folder, tokenizer_dir, tmp_path, monkeypatch,  # noqa: F811
                                                              capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails as when it is not installed
    monkeypatch.setattr(runs_module, "train_arm", lambda *a, **k: pytest.fail("trained"))
    data = write_rows(tmp_path / "rows.jsonl")
    with pytest.raises(SystemExit) as error:
        compare.main(argv(base_folder, data, tmp_path / "out", tokenizer=tokenizer_dir))
    err = capsys.readouterr().err
    assert error.value.code == 2
    assert "matplotlib, not installed here: pip install matplotlib" in err and "[plots] extra" in err and "--no_plots" in err
    assert not (tmp_path / "out").exists()
    # --no_plots runs without it, and draws nothing
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    compare.main(argv(base_folder, data, tmp_path / "out", "--no_plots", "--lrs", "1e-3", "--max_steps", "1",
                      tokenizer=tokenizer_dir))
    assert (tmp_path / "out" / "comparison.json").exists()
    assert not any((tmp_path / "out" / name).exists() for name in plots.PLOT_FILES)
