"""bench/evidence_numbers_data.py: the VADER reader on a tiny synthetic archive, and the feature extraction on the tiny
stand-in base (each prompt alone, resumable)."""

import io
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import evidence_numbers_data as data  # noqa: E402

# --- the VADER reader ----------------------------------------------------------------------------------------------


def tar_bytes(files: dict) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def sdist(tmp_path, tweets: str, movies: str = "1\t-0.6\tEffective but too tepid biopic\r\n") -> Path:
    inner = tar_bytes({
        "hutto_ICWSM_2014/tweets_GroundTruth.txt": tweets.encode(),
        "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt": movies.encode(),
        "hutto_ICWSM_2014/tweets_anonDataRatings.txt": b"1\t2.7\t[3, 2]\r\n",  # raw ratings: not ground truth
    })
    path = tmp_path / "vaderSentiment-3.3.2.tar.gz"
    path.write_bytes(tar_bytes({"vaderSentiment-3.3.2/setup.py": b"",
                                "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz": inner}))
    return path


def test_reader_finds_the_ground_truth_inside_the_sdist(tmp_path):
    path = sdist(tmp_path, "1\t2.726315789\tSo lucky.\r\n2\t-1.5\tnot\tgood\r\n\r\n3\t0\tmeh")
    rows = data.read_vader_ratings(path)
    assert rows == [
        {"source": "movieReviewSnippets_GroundTruth.txt", "id": "1", "rating": -0.6,
         "text": "Effective but too tepid biopic"},
        {"source": "tweets_GroundTruth.txt", "id": "1", "rating": 2.726315789, "text": "So lucky."},
        {"source": "tweets_GroundTruth.txt", "id": "2", "rating": -1.5, "text": "not\tgood"},
        {"source": "tweets_GroundTruth.txt", "id": "3", "rating": 0.0, "text": "meh"},
    ]
    inner = tmp_path / "inner.tar.gz"
    with tarfile.open(path) as archive:
        inner.write_bytes(archive.extractfile("vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz").read())
    assert data.read_vader_ratings(inner) == rows


@pytest.mark.parametrize("line, message", [
    ("2\tnan\tbad", "line 2 \\(id '2'\\): rating 'nan' is not a finite number"),
    ("2\t-inf\tbad", "line 2 \\(id '2'\\): rating '-inf' is not a finite number"),
    ("2\t\tbad", "line 2 \\(id '2'\\): no rating"),
    ("2", "line 2 \\(id '2'\\): no rating"),
    ("2\tgood\tbad", "line 2 \\(id '2'\\): rating 'good' is not a number"),
])
def test_reader_refuses_missing_and_non_finite_ratings_naming_the_row(tmp_path, line, message):
    with pytest.raises(ValueError, match="tweets_GroundTruth.txt " + message):
        data.read_vader_ratings(sdist(tmp_path, f"1\t1.0\tfine\r\n{line}\r\n"))


def test_reader_refuses_an_archive_without_ground_truth(tmp_path):
    path = tmp_path / "other.tar.gz"
    path.write_bytes(tar_bytes({"README": b"nothing"}))
    with pytest.raises(ValueError, match="no \\*_GroundTruth.txt"):
        data.read_vader_ratings(path)


def test_extraction_is_each_prompt_alone_and_resumes(sft_base, tmp_path):
    # left padding in a batch and a resumed cache must give what one unpadded forward of each prompt gives
    from transformers import AutoTokenizer, Qwen2Model

    words = "user assistant system".split()
    rows = [{"source": "tweets_GroundTruth.txt", "id": str(i), "rating": i / 4 - 1.0,
             "text": " ".join(words[j % 3] for j in range(1 + 3 * i % 7))} for i in range(10)]
    cache = tmp_path / "not" / "yet"  # the cache folder is made where missing (the default one is, on a fresh machine)
    first = data.extract_features(str(sft_base), rows, 6, cache, batch_size=2)
    assert len(first["keys"]) == 6
    store = data.extract_features(str(sft_base), rows, 10, cache, batch_size=2)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
    assert store["keys"] == [f"tweets_GroundTruth.txt:{i}" for i in order]
    assert store["rating"] == [rows[i]["rating"] for i in order]
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    model = Qwen2Model.from_pretrained(sft_base, dtype=torch.float32).eval()
    with torch.no_grad():
        for k, i in enumerate(order):
            ids = tokenizer(data.PROMPT.format(text=rows[i]["text"]), return_tensors="pt").input_ids
            torch.testing.assert_close(store["z"][k], model(ids).last_hidden_state[0, -1], atol=1e-5, rtol=1e-5)
