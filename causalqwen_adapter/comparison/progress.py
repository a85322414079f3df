"""A comparison's finished runs, kept in its output folder as each ends, so that a comparison cut short (a killed
process, a closed laptop) resumes where it stopped: the same command again trains only the runs still missing, and
its results are those of an uninterrupted run (each run starts from fresh heads and its own seed).

`comparison_runs.jsonl` holds what the runs were made from on its first line (the protocol, the rows' and labels'
digest, the base) and one finished run per line after it. Runs of another comparison in that folder are refused,
never mixed in; `restart` (the command's --overwrite or --rebuild_cache) ignores them and replaces the file with the
first run that ends. The file is removed once comparison.json holds every run."""

import dataclasses
import json
import os
from pathlib import Path

PROGRESS_FILE = "comparison_runs.jsonl"


def comparison_key(protocol, data_sha256: str, base: str) -> dict:
    """What the runs of a comparison are made from, as JSON reads it back."""
    return json.loads(json.dumps({"protocol": dataclasses.asdict(protocol), "data_sha256": data_sha256, "base": base}))


def run_key(run: dict) -> tuple:
    return run["arm"], run["seed"], run["lr"]


class RunLog:
    """The finished runs of the comparison `key` in `folder` (`done`: by (arm, seed, lr)), and the file new ones are
    added to."""

    def __init__(self, folder, key: dict, restart: bool = False):
        self.path, self.key, self.done = Path(folder) / PROGRESS_FILE, key, {}
        self._fresh = restart or not self.path.exists()  # the file is (re)written from its first line on
        if self._fresh:
            return
        lines = self.path.read_text().splitlines()
        saved = _parse(lines[0]) if lines else None
        if saved != key:
            differ = sorted(k for k in key if saved is None or saved.get(k) != key[k])
            if saved is not None and "protocol" in differ:
                differ = sorted(k for k in key["protocol"] if saved["protocol"].get(k) != key["protocol"][k])
            raise ValueError(f"{self.path} holds the finished runs of another comparison (it differs in "
                             f"{', '.join(differ) or 'its format'}): run the same command to resume it, pass "
                             "--overwrite to start again, or choose another --output_dir")
        for line in lines[1:]:
            run = _parse(line)
            if run is not None:  # a line cut short by the end of the process that wrote it: that run trains again
                self.done[run_key(run)] = run

    def add(self, run: dict) -> None:
        """Append a finished run (to disk before the next run starts)."""
        if self._fresh:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.key) + "\n")
            self._fresh = False
        with open(self.path, "a") as f:
            f.write(json.dumps(run) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finish(self) -> None:
        """The comparison's results are written: its runs are no longer needed here."""
        self.path.unlink(missing_ok=True)


def _parse(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
