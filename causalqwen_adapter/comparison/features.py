"""The base's final hidden states for a comparison, extracted once and cached: z at each prompt's end (where the
label's first token is the target) and z_label [N, K, H] at the label's position for every label of the set (the EOS
target TRL's SFT puts after a one-token label; a flipped label changes that input). A cache folder records what it
was made from (the base's config and weight files, the rows, the labels' tokens); a cache of another base or other
data is refused, never reused."""

import hashlib
import json
import os
from pathlib import Path

import torch

CACHE_FILE = "features.pt"
FINGERPRINT_FILE = "fingerprint.json"


def row_tokens(tokenizer, prompt: str, label_ids: list[int]) -> list[int]:
    """The prompt's tokens, checked against TRL's tokenization of prompt + label + EOS for every label: the label
    is one token right after the prompt, then EOS."""
    ids = tokenizer(text=prompt)["input_ids"]
    for label in label_ids:
        full = tokenizer(text=prompt + tokenizer.decode([label]) + tokenizer.eos_token)["input_ids"]
        if full != ids + [label, tokenizer.eos_token_id]:
            raise ValueError(f"prompt {prompt!r} + label {tokenizer.decode([label])!r} + EOS does not tokenize as the "
                             "prompt's tokens, the label's one token and EOS: use one-token labels and prompts that "
                             "end on a token boundary")
    return ids


@torch.no_grad()
def extract(backbone, prompts: list[list[int]], label_ids: list[list[int]] | None) -> dict[str, torch.Tensor]:
    """z [N, H] at each prompt's end; with `label_ids` (K token ids per prompt), z_label [N, K, H] at the label
    position for each of them (the prompt's KV cache repeated over the K labels: one forward of K tokens). The
    backbone runs on its own device; the features come back to the CPU (the cache, the splits and the metrics live
    there)."""
    device = next(backbone.parameters()).device
    z, z_label = [], []
    for n, ids in enumerate(prompts):
        out = backbone(input_ids=torch.tensor([ids], device=device), use_cache=label_ids is not None)
        z.append(out.last_hidden_state[0, -1].float().cpu())
        if label_ids is not None:
            cache = out.past_key_values
            cache.batch_repeat_interleave(len(label_ids[n]))
            step = backbone(input_ids=torch.tensor(label_ids[n], device=device)[:, None], past_key_values=cache,
                            use_cache=False)
            z_label.append(step.last_hidden_state[:, 0].float().cpu())
    out = {"z": torch.stack(z)}
    if label_ids is not None:
        out["z_label"] = torch.stack(z_label)
    return out


def base_fingerprint(base) -> dict:
    """What identifies a loaded base: its name, the sha256 of its config, and (for a local folder or a Hub snapshot)
    the name, size and modification time of each weight file (hashing gigabytes on every run would cost more than the
    comparison)."""
    name = str(base.config.name_or_path)
    config = hashlib.sha256(base.config.to_json_string(use_diff=False).encode()).hexdigest()
    files = {}
    folder = Path(name)
    if not folder.is_dir():
        from transformers.utils import cached_file

        try:
            folder = Path(cached_file(name, "config.json")).parent
        except OSError:
            folder = None
    if folder is not None:
        for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            stat = os.stat(path)
            files[path.name] = [stat.st_size, stat.st_mtime_ns]
    return {"base": name, "config_sha256": config, "weight_files": files, "dtype": str(base.dtype)}


def data_fingerprint(prompts: list[list[int]], targets: list[int], label_ids: list[int]) -> str:
    """The sha256 of the prompts' tokens, their label indices and the labels' tokens."""
    return hashlib.sha256(json.dumps([prompts, targets, label_ids]).encode()).hexdigest()


def cached_features(cache_dir, base, prompts: list[list[int]], targets: list[int], label_ids: list[int], *,
                    rebuild: bool = False, log=print) -> dict[str, torch.Tensor]:
    """{z, z_label, label} of every row, from `cache_dir` when it was made from this base and these rows, else
    extracted and written there. A cache of another base or other rows is refused unless `rebuild`."""
    folder = Path(cache_dir)
    fingerprint = {**base_fingerprint(base), "data_sha256": data_fingerprint(prompts, targets, label_ids),
                   "rows": len(prompts), "label_ids": list(label_ids)}
    path, record = folder / CACHE_FILE, folder / FINGERPRINT_FILE
    if path.exists() and not rebuild:
        saved = json.loads(record.read_text()) if record.exists() else None
        if saved != fingerprint:
            differ = sorted(k for k in fingerprint if saved is None or saved.get(k) != fingerprint[k])
            raise ValueError(f"the feature cache {folder} was made from another base or other data (differs in "
                             f"{', '.join(differ)}): pass --rebuild_cache to extract the features again there, or "
                             "choose another --cache_dir")
        log(f"features: {len(prompts)} rows read from {path}")
        return torch.load(path)
    record.unlink(missing_ok=True)  # a rebuild cut short leaves no record to vouch for the old features
    features = extract(base.base_model, prompts, [list(label_ids)] * len(prompts))
    features["label"] = torch.tensor(targets)
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(features, partial)
    os.replace(partial, path)
    record.write_text(json.dumps(fingerprint, indent=1) + "\n")
    log(f"features: {len(prompts)} rows extracted to {path}")
    return features
