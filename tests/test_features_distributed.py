"""Feature extraction across processes (distillation stage 1): `recipes/extract_features.py` started as `torchrun`
starts it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), 2 CPU processes on gloo, writes the same store as one
process: every row, in corpus order."""

import json
import os
import sys

import torch

from causalqwen_adapter.features import extract_features, features_info, load_features

from conftest import REPO_ROOT, free_port, run_processes

# Uneven on purpose: 7 sequences over 2 processes, one empty, one longer than max_length (truncated).
SEQUENCES = [[5, 9, 17, 3, 44, 60, 2], [7, 8], [], [100, 101, 102, 103, 104], [12], [30, 31, 32, 33],
             list(range(40, 75))]


def _launch(args: list[str], world: int, cwd) -> list[tuple[int, str]]:
    """The recipe in `world` processes with the environment torchrun gives each; (return code, stderr) per rank."""
    env = {**os.environ, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    script = [sys.executable, str(REPO_ROOT / "recipes" / "extract_features.py"), *args]
    results = run_processes([(script, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(world)],
                            cwd=cwd, what="the extraction processes")
    return [(code, err) for code, _, err in results]


def test_two_processes_write_the_store_one_process_writes(sft_base, tmp_path):
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in SEQUENCES))
    one = extract_features(str(sft_base), _dataset(data), tmp_path / "one",
                           top_k=4, max_length=32, batch_size=2, dtype="float32")

    results = _launch(["--model_name_or_path", str(sft_base), "--dataset_name", str(data), "--output_dir",
                       str(tmp_path / "two"), "--top_k", "4", "--max_length", "32", "--batch_size", "2",
                       "--dtype", "float32"], world=2, cwd=tmp_path)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank}: {err[-4000:]}"
    two, one = load_features(tmp_path / "two")[:], one[:]

    assert len(two["topk_ids"]) == len(one["topk_ids"]) == sum(min(len(s), 32) for s in SEQUENCES)
    assert torch.equal(two["topk_ids"], one["topk_ids"])  # the same rows in the same (corpus) order
    torch.testing.assert_close(two["topk_probs"], one["topk_probs"])
    torch.testing.assert_close(two["hidden_state"], one["hidden_state"])
    info_one, info_two = features_info(tmp_path / "one"), features_info(tmp_path / "two")
    for key in ("num_tokens", "num_sequences", "top_k", "teacher_name_or_path", "hidden_size"):
        assert info_two[key] == info_one[key], key
    assert info_two["num_sequences"] == len(SEQUENCES) - 1  # the empty text adds no row
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "one", "two"]  # no staging left behind


def test_an_error_in_the_processes_stops_them_all_and_writes_nothing(sft_base, tmp_path):
    data = tmp_path / "corpus.jsonl"
    # A token id outside the teacher's vocabulary: only the process that gets that sequence (the second) fails.
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in [[1, 2, 3], [1, 10**6], [4, 5]]))
    results = _launch(["--model_name_or_path", str(sft_base), "--dataset_name", str(data), "--output_dir",
                       str(tmp_path / "store"), "--top_k", "2"], world=2, cwd=tmp_path)
    assert [code != 0 for code, _ in results] == [True, True]  # none hangs, none succeeds
    assert "outside the teacher's vocabulary" in results[1][1]
    assert "feature extraction failed in process 1" in results[0][1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


def _dataset(path):
    from datasets import load_dataset

    return load_dataset("json", data_files=str(path), split="train")
