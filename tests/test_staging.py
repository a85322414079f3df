"""Saves where the target's parent cannot take the hidden staging folders: a parent this user cannot write, a target
that is a symbolic link to another filesystem, a target that is a mount point. The save stages inside the target,
keeps its guarantees (complete or as it was; a killed swap refuses to load and names the set-aside files), and a
folder nobody can write is refused up front, by the trainers and feature extraction before anything loads.

The tests run as root on one filesystem, so `Walls` simulates those limits where the code meets them: `os.access`,
`tempfile.mkdtemp`, `os.rename` / `os.replace` (EACCES, EXDEV, EBUSY as the kernel answers) and the device and
mount checks."""

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from test_distill import _args as _distill_args

import causalqwen_adapter.adapter_folder as adapter_folder
from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.distill import CausalDistillTrainer
from causalqwen_adapter.features import extract_features, load_features
from causalqwen_adapter.trainer import CausalSFTTrainer

from trainer_helpers import _args, _prompt_completion

CASES = ["parent not writable", "symlink to another filesystem", "mount point"]


def _real(path) -> Path:
    """Where an entry is: its folder resolved, its own name kept (a rename moves a link, not what it points to)."""
    path = os.path.abspath(path)
    return Path(os.path.realpath(os.path.dirname(path))) / os.path.basename(path)


class Walls:
    """Folders this user cannot write (`locked`), folders on another filesystem (`other`) and mount points among them
    (`mounts`), as the kernel would enforce them; `fail_replace_at` makes the n-th `os.replace` fail with ENOSPC."""

    def __init__(self, monkeypatch):
        self.locked, self.other, self.mounts = set(), set(), set()
        self.fail_replace_at, self.replaces = None, 0
        self.real = {"access": os.access, "rename": os.rename, "replace": os.replace, "mkdtemp": tempfile.mkdtemp,
                     "ismount": os.path.ismount}
        monkeypatch.setattr(os, "access", self.access)
        monkeypatch.setattr(os, "rename", lambda src, dst: self.move("rename", src, dst))
        monkeypatch.setattr(os, "replace", lambda src, dst: self.move("replace", src, dst))
        monkeypatch.setattr(tempfile, "mkdtemp", self.mkdtemp)
        monkeypatch.setattr(os.path, "ismount", lambda p: Path(os.path.realpath(p)) in self.mounts
                            or self.real["ismount"](p))
        monkeypatch.setattr(adapter_folder, "same_filesystem",
                            lambda a, b: self.filesystem(os.path.realpath(a)) == self.filesystem(os.path.realpath(b)),
                            raising=False)  # the device check (absent before staging_place)

    def filesystem(self, path) -> Path | None:
        path = Path(path)
        return next((root for root in self.other if path == root or root in path.parents), None)

    def access(self, path, mode, **kwargs):
        if mode & os.W_OK and Path(os.path.realpath(path)) in self.locked:
            return False
        return self.real["access"](path, mode, **kwargs)

    def mkdtemp(self, suffix=None, prefix=None, dir=None):
        if dir is not None and Path(os.path.realpath(dir)) in self.locked:
            raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, f"{prefix}XXXXXXXX{suffix}"))
        return self.real["mkdtemp"](suffix, prefix, dir)

    def move(self, how, src, dst):
        src_at, dst_at = _real(src), _real(dst)
        if src_at.parent in self.locked or dst_at.parent in self.locked:
            raise PermissionError(errno.EACCES, "Permission denied", str(src), None, str(dst))
        if src_at in self.mounts:
            raise OSError(errno.EBUSY, "Device or resource busy", str(src), None, str(dst))
        if self.filesystem(src_at) != self.filesystem(dst_at):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src), None, str(dst))
        if how == "replace":
            self.replaces += 1
            if self.replaces == self.fail_replace_at:
                raise OSError(errno.ENOSPC, "No space left on device", str(src), None, str(dst))
        return self.real[how](src, dst)


@pytest.fixture
def walls(monkeypatch) -> Walls:
    return Walls(monkeypatch)


def _place(case: str, walls: Walls, tmp_path: Path, name: str = "adapter") -> tuple[Path, Path, Path]:
    """(the folder a save is given, where its files land, the folder beside it): an existing, empty folder."""
    if case == "parent not writable":  # a user's folder inside a root-owned one
        parent = tmp_path / "shared"
        (parent / name).mkdir(parents=True)
        walls.locked.add(parent.resolve())
        return parent / name, parent / name, parent
    if case == "symlink to another filesystem":
        disk, work = tmp_path / "disk", tmp_path / "work"
        (disk / name).mkdir(parents=True)
        work.mkdir()
        (work / name).symlink_to(disk / name)
        walls.other.add(disk.resolve())
        return work / name, disk / name, work
    volume = tmp_path / name  # a container's volume
    volume.mkdir()
    walls.other.add(volume.resolve())
    walls.mounts.add(volume.resolve())
    return volume, volume, tmp_path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _hidden(*folders: Path) -> list[str]:
    return sorted(str(p) for f in folders for p in f.iterdir() if p.name.startswith("."))


def _heads(base, shift: float) -> CausalQwenForCausalLM:
    model = CausalQwenForCausalLM.from_base(base)
    with torch.no_grad():
        model.action.b_noise.add_(shift)
    return model


# --------------------------------------------------------------------------------------- adapters


@pytest.mark.parametrize("case", CASES)
def test_a_save_stages_inside_the_target_when_its_parent_cannot_take_it(tied_base, tmp_path, walls, case):
    target, lands, beside = _place(case, walls, tmp_path)
    _heads(tied_base, 0.0).save_pretrained(target)  # into the empty folder
    new = _heads(tied_base, 1.0)
    new.save_pretrained(target)  # over the adapter
    loaded = CausalQwenForCausalLM.from_pretrained(target)
    assert torch.equal(loaded.action.b_noise, new.action.b_noise)
    assert (lands / "config.json").is_file() and _hidden(beside, lands) == []
    assert target.is_symlink() == (case == "symlink to another filesystem")  # a link stays a link
    assert 'from_pretrained("adapter"' in (lands / "README.md").read_text()  # the card names the target


@pytest.mark.parametrize("case", CASES)
def test_a_save_failing_mid_swap_inside_the_target_leaves_the_old_adapter(tied_base, tmp_path, walls, case):
    target, lands, beside = _place(case, walls, tmp_path)
    _heads(tied_base, 0.0).save_pretrained(target)
    old = _snapshot(lands)
    walls.replaces, walls.fail_replace_at = 0, 3  # config.json and one file set aside, a new file failing to go in
    with pytest.raises(OSError) as err:
        _heads(tied_base, 1.0).save_pretrained(target)
    message = str(err.value)
    assert err.value.errno == errno.ENOSPC
    assert f"could not save the adapter to {os.path.abspath(target)}: No space left on device" in message
    assert "was left as it was" in message
    assert _snapshot(lands) == old and _hidden(beside, lands) == []


def test_a_save_error_names_the_target_and_the_cause_not_only_the_hidden_path(tied_base, tmp_path, walls):
    target = tmp_path / "adapter"
    _heads(tied_base, 0.0).save_pretrained(target)
    old = _snapshot(target)
    walls.fail_replace_at = walls.replaces + 1
    with pytest.raises(OSError, match=rf"could not save the adapter to {target}: No space left on device \(at .*"
                                      rf"\.adapter\.\w{{8}}\.(tmp|old)"):
        _heads(tied_base, 1.0).save_pretrained(target)
    assert _snapshot(target) == old and _hidden(tmp_path) == []


def test_a_folder_nobody_can_write_is_refused_naming_it(tied_base, tmp_path, walls):
    parent = tmp_path / "shared"
    (parent / "adapter").mkdir(parents=True)
    walls.locked |= {parent.resolve(), (parent / "adapter").resolve()}
    model = _heads(tied_base, 0.0)
    with pytest.raises(PermissionError, match=rf"cannot save the adapter to {parent / 'adapter'}: this folder is not "
                                              r"writable \(owner uid \d+.*chmod u\+w"):
        model.save_pretrained(parent / "adapter")
    # a folder still to be created: the one it would be created in is named
    with pytest.raises(PermissionError, match=rf"{parent / 'new' / 'adapter'}: it does not exist and {parent}, where "
                                              "it would be created, is not writable"):
        model.save_pretrained(parent / "new" / "adapter")
    assert sorted(p.name for p in parent.iterdir()) == ["adapter"] and not any((parent / "adapter").iterdir())


KILL_MID_SWAP_INSIDE = """
import os, sys
import torch
from causalqwen_adapter import CausalQwenForCausalLM
parent = os.path.realpath(os.path.dirname(sys.argv[2]))
real_access, real_replace, calls = os.access, os.replace, []
os.access = lambda p, mode, **kw: False if mode & os.W_OK and os.path.realpath(p) == parent else real_access(p, mode, **kw)
def die(src, dst):
    calls.append(dst)
    if len(calls) == 3:  # config.json and one file set aside, the new file not yet in
        os.kill(os.getpid(), 9)
    real_replace(src, dst)
os.replace = die
model = CausalQwenForCausalLM.from_base(sys.argv[1])
with torch.no_grad():
    model.action.b_noise.add_(1.0)
model.save_pretrained(sys.argv[2])
"""


def test_a_save_killed_mid_swap_inside_the_target_refuses_to_load_and_names_the_old_files(tied_base, tmp_path, walls):
    from causalqwen_adapter.cli.push import adapter_files

    target, _, parent = _place("parent not writable", walls, tmp_path)
    _heads(tied_base, 0.0).save_pretrained(target)
    old = _snapshot(target)
    proc = subprocess.run([sys.executable, "-c", KILL_MID_SWAP_INSIDE, str(tied_base), str(target)],
                          capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert _hidden(parent) == []  # nothing staged beside it
    [aside] = [p for p in target.iterdir() if p.name.startswith(".adapter.") and p.name.endswith(".old")]
    assert not (target / "config.json").exists() and (aside / "config.json").is_file()

    with pytest.raises(OSError, match=rf"interrupted.*{aside}.*move them back"):
        CausalQwenForCausalLM.from_pretrained(target)
    with pytest.raises(ValueError, match=rf"interrupted.*{aside}"):
        adapter_files(target)
    # the message is right: the old files moved back restore the old adapter exactly
    restored = {k: v for k, v in _snapshot(target).items() if not k.startswith(".")}
    restored.update(_snapshot(aside))
    assert restored == old

    _heads(tied_base, 0.0).save_pretrained(target)  # the next save removes what the killed one left
    assert _hidden(parent, target) == [] and _snapshot(target) == old


# --------------------------------------------------------------------------------------- feature stores


DATA = Dataset.from_dict({"text": ["the cat sat on the mat"]})


@pytest.mark.parametrize("case", CASES)
def test_feature_extraction_stages_inside_the_target_when_its_parent_cannot_take_it(sft_base, tmp_path, walls, case):
    target, lands, beside = _place(case, walls, tmp_path, name="features")
    extract_features(str(sft_base), DATA, target, top_k=2)
    old = _snapshot(lands)
    walls.replaces, walls.fail_replace_at = 0, 3
    with pytest.raises(OSError, match=rf"could not save the features to {target}: No space left on device"):
        extract_features(str(sft_base), DATA, target, top_k=3, overwrite=True)
    assert _snapshot(lands) == old and _hidden(beside, lands) == []

    walls.fail_replace_at = None
    extract_features(str(sft_base), DATA, target, top_k=3, overwrite=True)
    assert load_features(target)[0]["topk_ids"].shape == (3,) and _hidden(beside, lands) == []
    assert target.is_symlink() == (case == "symlink to another filesystem")


def test_a_feature_store_swap_killed_inside_the_target_names_the_old_files(sft_base, tmp_path, walls):
    target, _, parent = _place("parent not writable", walls, tmp_path, name="features")
    extract_features(str(sft_base), DATA, target, top_k=2)
    aside = target / ".features.abcd1234.old"  # what a swap killed after setting the store's info aside leaves
    aside.mkdir()
    (target / "causalqwen_features.json").rename(aside / "causalqwen_features.json")
    with pytest.raises(FileNotFoundError, match=rf"interrupted while swapping.*{aside}: move them back"):
        load_features(target)
    with pytest.raises(FileExistsError, match="not a feature store"):  # overwrite replaces only a store
        extract_features(str(sft_base), DATA, target, top_k=3, overwrite=True)
    (aside / "causalqwen_features.json").rename(target / "causalqwen_features.json")
    extract_features(str(sft_base), DATA, target, top_k=3, overwrite=True)
    assert _hidden(parent, target) == [] and load_features(target)[0]["topk_ids"].shape == (3,)


# --------------------------------------------------------------------------------------- up front


def _unwritable(walls: Walls, tmp_path: Path) -> tuple[Path, Path]:
    """(a root-owned folder, an existing folder inside it this user cannot write either)."""
    locked = tmp_path / "root-owned"
    (locked / "theirs").mkdir(parents=True)
    walls.locked |= {locked.resolve(), (locked / "theirs").resolve()}
    return locked, locked / "theirs"


def test_trainers_refuse_an_output_dir_they_cannot_write_before_loading_anything(tmp_path, walls):
    locked, theirs = _unwritable(walls, tmp_path)
    missing = str(tmp_path / "no-such-model")  # loading it would fail: the output_dir check comes first
    with pytest.raises(PermissionError, match=rf"{locked / 'run' / 'out'}: it does not exist and {locked}, where it "
                                              "would be created, is not writable"):
        CausalSFTTrainer(missing, args=_args(locked / "run" / "out"), train_dataset=_prompt_completion())
    with pytest.raises(PermissionError, match=rf"cannot save the checkpoints and the adapter to {theirs}: this "
                                              "folder is not writable"):
        CausalSFTTrainer(missing, args=_args(theirs), train_dataset=_prompt_completion())
    with pytest.raises(PermissionError, match=rf"{theirs}: this folder is not writable"):
        CausalDistillTrainer(missing, args=_distill_args(theirs), train_dataset=str(tmp_path / "features"))
    assert sorted(p.name for p in locked.iterdir()) == ["theirs"]


def test_a_trainer_saves_into_an_output_dir_whose_parent_it_cannot_write(sft_base, tmp_path, walls):
    out, _, parent = _place("parent not writable", walls, tmp_path, name="out")
    trainer = CausalSFTTrainer(str(sft_base), args=_args(out, max_steps=1), train_dataset=_prompt_completion())
    trainer.train()
    trainer.save_model()
    CausalQwenForCausalLM.from_pretrained(out)
    assert (out / "training_args.bin").is_file() and _hidden(parent, out) == []


def test_feature_extraction_refuses_a_folder_it_cannot_write_before_the_teacher_loads(tmp_path, walls):
    from causalqwen_adapter.cli import extract_features as recipe

    locked, theirs = _unwritable(walls, tmp_path)
    missing = str(tmp_path / "no-such-teacher")
    with pytest.raises(PermissionError, match=rf"cannot save the features to {theirs}: this folder is not writable"):
        extract_features(missing, DATA, theirs, top_k=2)
    args = recipe.ExtractArguments(model_name_or_path=missing, dataset_name=str(tmp_path / "no-such-data.jsonl"),
                                   output_dir=str(locked / "features"), top_k=2, device="cpu")
    with pytest.raises(PermissionError, match=rf"{locked / 'features'}: it does not exist and {locked}, where it "
                                              "would be created"):
        recipe.run(args)  # before the dataset or the teacher loads
    assert sorted(p.name for p in locked.iterdir()) == ["theirs"]


# --------------------------------------------------------------------------------------- prepare-base


@pytest.fixture
def quick_prepare_base(monkeypatch):
    """causalqwen prepare-base with the GGUF join and the conversion replaced by a few small files (each build's
    config.json holds its number), so its staging and install run in milliseconds."""
    from causalqwen_adapter.cli import prepare_base

    builds = []

    def convert(spec, gguf_path, dest):
        assert gguf_path.is_file()  # the join's output, in the staging folder
        dest.mkdir()
        builds.append(dest)
        for name in prepare_base.REQUIRED_FILES:
            (dest / name).write_text(f'{{"build": {len(builds)}}}')
        return {"parameters": 1, "versions": {"transformers": "5", "torch": "2", "gguf": "0"},
                "embed_vs_head_rel_diff": 0.07}

    monkeypatch.setattr(prepare_base, "join_parts", lambda spec, sources, path: path.write_bytes(b"gguf"))
    monkeypatch.setattr(prepare_base, "convert", convert)
    monkeypatch.setattr(prepare_base, "locate_parts", lambda spec: [])
    monkeypatch.setattr(prepare_base, "missing_modules", lambda names: [])  # gguf (the demo extra): its reader is mocked
    return prepare_base


@pytest.mark.parametrize("case", CASES)
def test_prepare_base_stages_inside_the_target_when_its_parent_cannot_take_it(quick_prepare_base, tmp_path, walls,
                                                                              case):
    target, lands, beside = _place(case, walls, tmp_path, name="base")
    quick_prepare_base.prepare_demo_base(target)  # into the empty folder
    assert quick_prepare_base.is_finished_build(lands) and (lands / "config.json").read_text() == '{"build": 1}'
    quick_prepare_base.prepare_demo_base(target, force=True)  # over the finished build
    assert (lands / "config.json").read_text() == '{"build": 2}' and quick_prepare_base.is_finished_build(lands)
    assert _hidden(beside, lands) == []
    assert target.is_symlink() == (case == "symlink to another filesystem")  # a link stays a link

    old = _snapshot(lands)
    walls.replaces, walls.fail_replace_at = 0, 3  # the marker and one file set aside, a new file failing to go in
    with pytest.raises(quick_prepare_base.DemoBaseError, match=rf"could not save .* to {target}: No space left on "
                                                                "device .*was left as it was"):
        quick_prepare_base.prepare_demo_base(target, force=True)
    assert _snapshot(lands) == old and _hidden(beside, lands) == []


def test_prepare_base_refuses_a_folder_it_cannot_write_before_any_work(quick_prepare_base, tmp_path, walls):
    locked, theirs = _unwritable(walls, tmp_path)
    with pytest.raises(quick_prepare_base.DemoBaseError, match=rf"{locked / 'base'}: it does not exist and {locked}, "
                                                                "where it would be created, is not writable"):
        quick_prepare_base.prepare_demo_base(locked / "base")
    with pytest.raises(quick_prepare_base.DemoBaseError, match=rf"{theirs}: this folder is not writable"):
        quick_prepare_base.prepare_demo_base(theirs)
    wheels_at = tmp_path / "mine" / "base"  # another base's wheels go beside it by default: there they cannot
    wheels_at.mkdir(parents=True)
    walls.locked.add(wheels_at.parent.resolve())
    with pytest.raises(quick_prepare_base.DemoBaseError, match=r"downloaded wheels .*\(--wheel_dir chooses"):
        quick_prepare_base.prepare_demo_base(wheels_at, base="smollm2-135m")
    assert sorted(p.name for p in locked.iterdir()) == ["theirs"] and not any(wheels_at.iterdir())


def test_prepare_base_after_a_killed_rebuild_inside_the_target(quick_prepare_base, tmp_path, walls):
    target, _, parent = _place("parent not writable", walls, tmp_path, name="base")
    quick_prepare_base.prepare_demo_base(target)
    # what a rebuild killed while swapping leaves: the marker set aside, and the staging folder with a half build
    aside, staged = target / ".base.abcd1234.old", target / ".base.efgh5678.tmp"
    aside.mkdir()
    (staged / "gguf").mkdir(parents=True)
    (target / quick_prepare_base.MARKER_NAME).rename(aside / quick_prepare_base.MARKER_NAME)
    assert not quick_prepare_base.is_finished_build(target)
    with pytest.raises(quick_prepare_base.DemoBaseError, match="pass --force to replace it"):
        quick_prepare_base.prepare_demo_base(target)  # still its own build, not someone's files
    quick_prepare_base.prepare_demo_base(target, force=True)
    assert quick_prepare_base.is_finished_build(target) and _hidden(parent, target) == []
