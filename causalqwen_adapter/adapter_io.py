"""Adapter I/O (docs/design.md, The adapter folder): attaching fresh heads to a base, saving, uploading and loading an
adapter, as `CausalAdapterMixin`. The functions it calls live in `base_loading.py` (the base) and
`adapter_folder.py` (the folder on disk); their names are re-exported here.

Shipped as remote code: imports only the standard library, torch, transformers, safetensors and huggingface_hub.
"""

import inspect
import json
import os
import shutil
import weakref
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedModel,
)
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import cached_file

from .adapter_folder import (
    ADAPTER_WEIGHTS_NAME,
    BASE_PREFIXES,
    LORA_FOLDER,
    LORA_WEIGHTS_NAME,
    adapter_file_names,
    all_finite,
    check_keys,
    check_not_foreign,
    check_weights_header,
    give_plain_modes,
    install_folder,
    interrupted_swap,
    is_adapter_folder,
    keeps_tokenizer_config,
    non_finite_tensors,
    staged_save,
    stale_save_folders,
)
from .base_loading import (
    ADAPTER_HINT,
    BASE_HINT,
    HUB_KWARGS,
    MODEL_HINT,
    SUPPORTED_BASES,
    base_config_dict,
    base_is_tied,
    base_reference,
    causal_lm_parts,
    check_base_matches,
    check_config_overrides,
    check_found,
    check_logits_are_output_layer,
    check_supported_base,
    load_backbone,
    load_backbone_lora,
    load_generation_config,
    output_layer_expected,
    read_output_layer,
    reject_unknown,
)
from .configuration_causalqwen import check_number
from .model_card import write_model_card
from .sharding import gathered, gathered_tensors
from .tokenization_causalqwen import TOKENIZER_CONFIG, TOKENIZER_CONFIG_NAME

__all__ = [
    "ADAPTER_HINT", "ADAPTER_WEIGHTS_NAME", "BASE_HINT", "BASE_PREFIXES", "HUB_KWARGS", "LORA_FOLDER",
    "LORA_WEIGHTS_NAME", "MODEL_HINT", "SUPPORTED_BASES", "CausalAdapterMixin", "adapter_file_names", "all_finite",
    "base_config_dict", "base_is_tied", "base_reference", "causal_lm_parts", "check_base_matches",
    "check_config_overrides", "check_found", "check_keys", "check_logits_are_output_layer", "check_not_foreign",
    "check_supported_base", "check_weights_header", "give_plain_modes", "install_folder", "interrupted_swap",
    "is_adapter_folder", "keeps_tokenizer_config", "load_backbone", "load_backbone_lora", "load_generation_config",
    "non_finite_tensors", "output_layer_expected", "read_output_layer", "reject_unknown", "stale_save_folders",
]


class CausalAdapterMixin:
    """Building, saving and loading a CausalQwen model as an adapter: only the heads' tensors are written, the base is
    referenced by name. Mixed into `CausalQwenModel` ahead of `PreTrainedModel`, whose save/load it replaces."""

    @classmethod
    def _remote_code_files(cls) -> list[str]:
        """The modeling file and every file it imports relatively (configuration, heads, Cauchy math, this file)."""
        modeling = next(c for c in cls.__mro__ if c.__module__.rsplit(".", 1)[-1] == "modeling_causalqwen")
        this = inspect.getfile(modeling)
        return [this] + sorted(set(get_relative_import_files(this)))  # a file two others import is copied once

    # ------------------------------------------------------------------ building

    @classmethod
    def from_base(cls, base, *, revision=None, dtype="auto", device_map=None, **config_overrides):
        """Attach fresh causal heads (seed initialisation) to a base: any decoder-only causal LM that transformers'
        `AutoModelForCausalLM` loads (`SUPPORTED_BASES`). The heads wrap its backbone and copy its output layer.

        `base` is a Hub id, a local folder, or a loaded causal LM (a `*ForCausalLM`). `config_overrides` are
        `CausalQwenConfig` fields (`causal_size`, `gamma_init`, ...); Hub options go to the base loader. A base whose
        logits are not its output layer applied to its final hidden state is refused (`check_supported_base`,
        `check_logits_are_output_layer`): the heads could not start where it is.
        """
        hub_kwargs = {k: config_overrides.pop(k) for k in HUB_KWARGS if k in config_overrides and k != "revision"}
        check_config_overrides(config_overrides)
        if isinstance(base, (str, os.PathLike)):
            base_name = base_reference(str(base), "base")
            base_config_dict(base_name, "base", revision, **hub_kwargs)  # a missing folder or an adapter: refused
            base_config = AutoConfig.from_pretrained(base_name, revision=revision, **hub_kwargs)
            check_supported_base(base_config, base_name)
            base, info = AutoModelForCausalLM.from_pretrained(base_name, config=base_config, revision=revision,
                                                              dtype=dtype, device_map=device_map,
                                                              output_loading_info=True, **hub_kwargs)
            if info["missing_keys"]:  # e.g. a saved backbone alone: its output layer would be random, so would W_A
                raise ValueError(
                    f"{base_name}: the checkpoint lacks weights the {type(base).__name__} needs, "
                    f"{sorted(info['missing_keys'])[:5]} (freshly initialised, not the base's): the heads copy the "
                    "base's output layer, so pass the causal LM checkpoint itself (one that holds its lm_head, or "
                    "ties it to the embedding)"
                )
        elif isinstance(base, PreTrainedModel):
            base_name = base_reference(base.config.name_or_path, "base")
        else:
            raise TypeError(
                f"base must be a Hub id, a local folder or a loaded causal LM (a transformers *ForCausalLM), got "
                f"{type(base).__name__}; CausalQwen heads attach to {SUPPORTED_BASES}"
            )
        backbone, lm_head = causal_lm_parts(base, base_name)
        check_logits_are_output_layer(base, backbone, lm_head, base_name)
        config = cls.config_class(
            base_model_name_or_path=base_name, base_model_revision=revision, text_config=base.config, **config_overrides
        )
        for name in ("gamma_init", "b_noise_init", "ovr_threshold_init"):  # they must fit the heads' dtype (fp16: 65504)
            check_number(name, getattr(config, name), dtype=lm_head.weight.dtype)
        tied = base_is_tied(config.text_config)
        model = cls._assemble(config, backbone, None if tied else lm_head)
        with torch.no_grad():
            model.abduction.reset_parameters(config.gamma_init)
            # a base built partitioned (DeepSpeed ZeRO-3 with zero3_init_flag) is gathered for the copy only: every
            # rank reads the output layer, nothing else of the base
            with gathered(*(p for p in (lm_head.weight, lm_head.bias) if p is not None)):
                weight = lm_head.weight
                if config.causal_size != config.text_config.hidden_size:
                    # W_A = W_base · W_loc⁺ keeps loc_S = W_base z exactly when C > H (W_loc⁺ W_loc = I)
                    # and as the least-squares best when C < H.
                    pinv = torch.linalg.pinv(model.abduction.loc.weight.double())
                    weight = (weight.double() @ pinv).to(weight.dtype)
                model.action.reset_parameters(config.b_noise_init, weight, lm_head.bias)
            if config.numeric:
                model.numeric.reset_parameters()  # median 0, scale 1 until the trainer sees the data
        model.generation_config = base.generation_config
        # For verify_initialization, outside the module tree, never saved. Held strongly only when the model keeps
        # its weight anyway (tied embedding, or W_A bound to it); an untied base's own V×H matrix beside a "full"
        # W_A copy lives only as long as the caller keeps the base.
        shared = tied or config.action_weight != "full"
        model.__dict__["_base_lm_head"] = lm_head if shared else weakref.ref(lm_head)
        return model

    @classmethod
    def _assemble(cls, config, backbone, lm_head=None):
        """Build the model around a loaded backbone; the heads are allocated but not initialised."""
        with torch.device("meta"):  # no wasted initialisation of vocabulary-sized heads
            model = cls(config, backbone=backbone, lm_head=lm_head if config.action_weight != "full" else None)
        # The heads read the final hidden state: on the device of the backbone's last parameter (its final norm), in
        # the dtype of its embeddings (the model's; a norm may be kept in float32).
        anchor = torch.empty(0, dtype=backbone.get_input_embeddings().weight.dtype,
                             device=list(backbone.parameters())[-1].device)
        for name in ("abduction", "action", "ovr", "numeric")[: 4 if config.numeric else 3]:
            head = getattr(model, name).to(dtype=anchor.dtype)
            head.to_empty(device=anchor.device)
            setattr(model, name, head)
        if config.learnable_threshold:  # thresholds stay float32 like the loss math
            model.ovr.float()
        if config.numeric:  # b = a median of the data: bf16 would round it (12345.6 → 12352)
            model.numeric.float()
        model.ovr.reset_parameters()  # a scalar threshold is config, not an adapter tensor: set it here
        return model

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors an adapter folder stores: every persistent tensor outside the backbone."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(BASE_PREFIXES)}

    def gathered_adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """`adapter_state_dict` with whole tensors under sharded training (FSDP2, ZeRO-3): only the adapter's tensors are
        gathered, never the frozen base. A collective: every rank calls it; any rank may then save what it returns."""
        keys = self.adapter_keys()
        return gathered_tensors({k: v for k, v in self.state_dict(keep_vars=True).items() if k in keys})

    def adapter_keys(self) -> set[str]:
        return set(self._adapter_tensors())

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The persistent tensors outside the backbone, as `state_dict(keep_vars=True)` names them, read from the head
        modules alone (the backbone's hundreds of tensors are not walked; the model holds no tensor of its own)."""
        tensors = {}
        for name, module in self.named_children():
            if f"{name}." not in BASE_PREFIXES:
                module.state_dict(destination=tensors, prefix=f"{name}.", keep_vars=True)
        return tensors

    # ------------------------------------------------------------------ saving

    def save_pretrained(self, save_directory, is_main_process=True, state_dict=None, push_to_hub=False, **kwargs):
        """Write the adapter folder of docs/design.md (The adapter folder) atomically: config, adapter tensors, remote code.

        A new folder appears complete or not at all; files in an existing folder are swapped with
        `config.json` last, so an interrupted save leaves a folder that refuses to load, never one
        that loads wrong. Other files in the folder (a trainer's checkpoints) are left untouched.
        Refused before anything is written: tensors that are not finite, and a folder that is not an
        adapter's holding a file of a name the save writes (`check_not_foreign`).
        """
        reject_unknown(kwargs, ("safe_serialization", "max_shard_size", "variant"), "save_pretrained")
        if kwargs.get("safe_serialization") is False or kwargs.get("variant"):
            raise ValueError("adapters are always saved as a single `model.safetensors`: drop safe_serialization/variant")
        if push_to_hub:
            raise NotImplementedError("push_to_hub from save_pretrained is not supported yet: call model.push_to_hub(repo_id)")
        target = Path(os.path.abspath(save_directory))  # "." has a name, the card and the staging folder use it
        if target.exists() and not target.is_dir():
            raise FileExistsError(f"cannot save the adapter to {target}: it is an existing file, not a folder")
        if target.is_dir():
            check_not_foreign(target)
        if not is_main_process:
            return
        if not self.config.base_model_name_or_path:
            raise ValueError(
                "config.base_model_name_or_path is empty, so the adapter could not find its base when loaded: "
                "set model.config.base_model_name_or_path to the base's Hub id or folder"
            )
        tensors = self.adapter_state_dict() if state_dict is None else {
            k: v for k, v in state_dict.items() if not k.startswith(BASE_PREFIXES)
        }
        check_keys(set(tensors), self.adapter_keys(), "the state_dict to save")
        bad = sorted(k for k, v in tensors.items() if not all_finite(v))
        if bad:  # before anything is written: such a folder would refuse to load, and would replace a good one
            raise ValueError(
                f"the adapter tensors {bad} hold NaN or infinite values: the heads diverged, and a folder holding them "
                f"would refuse to load. Nothing was written ({target} is as it was); save heads that are finite (an "
                "earlier checkpoint, or training with a lower learning_rate)."
            )

        with staged_save(target, "the adapter") as staging:  # beside the target, or inside it (staging_place)
            self._write_adapter_files(staging, tensors, tokenizer_config=not keeps_tokenizer_config(target))
            install_folder(staging, target)
        # the folder is whole again: what killed saves left beside it is superseded
        for stale in stale_save_folders(target):
            shutil.rmtree(stale, ignore_errors=True)

    def _write_adapter_files(self, folder: Path, tensors: dict, tokenizer_config: bool = True) -> None:
        config = self.config.to_dict()
        config["architectures"] = ["CausalQwenForCausalLM"]
        config["auto_map"] = {
            "AutoConfig": "configuration_causalqwen.CausalQwenConfig",
            "AutoModel": "modeling_causalqwen.CausalQwenModel",
            "AutoModelForCausalLM": "modeling_causalqwen.CausalQwenForCausalLM",
        }
        config["dtype"] = str(self.action.bias.dtype).removeprefix("torch.")
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, folder / ADAPTER_WEIGHTS_NAME,
                  metadata={"format": "pt"})
        for source in self._remote_code_files():
            shutil.copyfile(source, folder / Path(source).name)
        if getattr(self, "generation_config", None) is not None:
            self.generation_config.save_pretrained(folder)
        if tokenizer_config:  # AutoTokenizer.from_pretrained(folder) gives the base's tokenizer (tokenization_causalqwen)
            (folder / TOKENIZER_CONFIG_NAME).write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
        if getattr(self.model, "_hf_peft_config_loaded", False):
            # LoRA on the backbone, in PEFT's format under lora/ (never at the root: transformers
            # would then take the whole folder for a PEFT adapter).
            self.model.save_pretrained(folder / LORA_FOLDER)
            bad = non_finite_tensors(folder / LORA_FOLDER / LORA_WEIGHTS_NAME)
            if bad:  # checked before anything is swapped in: a good lora/ in the target stays
                raise ValueError(f"the backbone LoRA tensors {bad[:5]} hold NaN or infinite values: the adapter was not "
                                 "saved (it would load and output NaN). Training diverged; lower learning_rate or "
                                 "resume from an earlier checkpoint")
        write_model_card(self, folder)  # never fails the save; a trainer records its run in self.training_summary
        # config.json is the commit marker: written last, swapped in last.
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")

    def push_to_hub(self, repo_id, *, private=None, token=None, revision=None, commit_message=None, create_pr=False,
                    base_model_id=None):
        """Upload exactly the adapter folder (what `save_pretrained` writes, card included) to the Hub repo `repo_id`.

        Saves into a temporary folder, creates the repo if needed (`private` applies then), and uploads that folder
        as one commit on `revision` (created from main when missing) or as a pull request (`create_pr`). The pushed
        config and card name the base by its Hub id: `base_model_id` (e.g. "Qwen/Qwen2.5-0.5B-Instruct"), required
        when the model was built on a local folder, which nobody else could load. The repo id, the base and the
        token are checked before anything is written or sent. Returns huggingface_hub's `CommitInfo`.
        """
        try:  # sharing belongs to the installed package: the remote code carries no upload code
            from causalqwen_adapter.hub import push_adapter
        except ImportError:
            raise ImportError(
                "push_to_hub uploads with the causalqwen-adapter package, which is not installed here: install it from "
                "its source (in a clone of the project: pip install .), or save_pretrained the adapter and upload the "
                "folder yourself"
            ) from None
        return push_adapter(self, repo_id, private=private, token=token, revision=revision,
                            commit_message=commit_message, create_pr=create_pr, base_model_id=base_model_id)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, base_model=None, base_model_revision=None,
                        config=None, dtype="auto", device_map=None, trust_remote_code=None, adapter_kwargs=None,
                        code_revision=None, _from_auto=False, _commit_hash=None, **kwargs):
        """Load the base named in the adapter's config (or `base_model`), then the adapter's heads.

        `pretrained_model_name_or_path` is an adapter folder or Hub id (files resolved through
        transformers' `cached_file`, so the Hub cache and `HF_HUB_OFFLINE=1` work). `base_model`
        may be a Hub id, a folder, a loaded causal LM (`*ForCausalLM`) or its backbone. The remaining keyword arguments
        (`attn_implementation`, `low_cpu_mem_usage`, ...) go to the base's `from_pretrained`.

        `trust_remote_code`, `adapter_kwargs`, `code_revision`, `_from_auto` and `_commit_hash` are what transformers'
        Auto classes pass along about the adapter repository (its code, a PEFT adapter inside it, its revision);
        they are taken here so that they do not reach the base's loading, which reads another repository.
        """
        if model_args:
            raise TypeError(f"{cls.__name__}.from_pretrained takes no extra positional arguments, got {model_args}")
        adapter = str(pretrained_model_name_or_path)
        check_found(adapter, "adapter", ADAPTER_HINT)
        hub_kwargs = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
        hub_kwargs = {k: v for k, v in hub_kwargs.items() if v is not None}
        if "torch_dtype" in kwargs:
            dtype = kwargs.pop("torch_dtype")
        if not os.path.isdir(adapter):  # a Hub id not found or out of reach (HF_HUB_OFFLINE): transformers' answer
            try:
                cached_file(adapter, "config.json", **hub_kwargs)
            except OSError as err:  # the offline answer does not say which repository it could not reach
                if adapter in str(err):
                    raise
                raise OSError(f"cannot load the adapter {adapter!r}: {err}") from err
        if not isinstance(config, cls.config_class):
            if cached_file(adapter, "config.json", _raise_exceptions_for_missing_entries=False, **hub_kwargs) is None:
                aside = interrupted_swap(Path(adapter)) if os.path.isdir(adapter) else None
                if aside is not None:
                    raise OSError(
                        f"{adapter} has no config.json: a save into it was interrupted while swapping its files. The "
                        f"previous adapter's config.json and the files already replaced are in {aside}: move them back "
                        f"into {adapter} to restore that adapter, or save the adapter again (which removes {aside})."
                    )
                raise OSError(
                    f"{adapter} has no config.json: it is not a complete CausalQwen adapter (an interrupted "
                    "save leaves it so). Save it again with save_pretrained."
                )
            config_dict, _ = cls.config_class.get_config_dict(adapter, **hub_kwargs)
            if config_dict.get("model_type") != cls.config_class.model_type:
                raise ValueError(
                    f"{adapter} is a {config_dict.get('model_type')!r} checkpoint, not a CausalQwen adapter: "
                    f"to attach fresh heads to a base use {cls.__name__}.from_base({adapter!r})"
                )
            config = cls.config_class.from_dict(config_dict)
        weights_file = cached_file(adapter, ADAPTER_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        if weights_file is None:
            raise OSError(
                f"{adapter} has no {ADAPTER_WEIGHTS_NAME}: it is not a complete CausalQwen adapter "
                "(was the save interrupted?). Save it again with save_pretrained."
            )

        check_weights_header(weights_file, config, cls)  # before the base loads or a head is allocated
        base_hub_kwargs = {k: v for k, v in hub_kwargs.items() if k not in ("revision", "subfolder")}
        backbone, lm_head, base_name = load_backbone(
            config, base_model, base_model_revision, dtype, device_map, {**base_hub_kwargs, **kwargs}
        )
        check_base_matches(config, backbone.config, base_name)
        config.text_config = backbone.config
        if base_model is not None and isinstance(base_model, (str, os.PathLike)):
            config.base_model_name_or_path = str(base_model)
            config.base_model_revision = base_model_revision
        model = cls._assemble(config, backbone, lm_head)
        model._load_adapter_weights(weights_file)
        load_backbone_lora(backbone, adapter, hub_kwargs)
        model.generation_config = load_generation_config(adapter, hub_kwargs, backbone)
        model.name_or_path = adapter
        model.eval()
        return model

    def _load_adapter_weights(self, weights_file: str) -> None:
        try:
            tensors = load_file(weights_file)
        except (SafetensorError, OSError, ValueError) as err:
            raise OSError(f"cannot read adapter weights {weights_file}: {err}. The file is corrupt; save the adapter again.") from err
        own = self._adapter_tensors()
        check_keys(set(tensors), set(own), weights_file)
        for key, value in tensors.items():
            if tuple(value.shape) != tuple(own[key].shape):
                raise ValueError(
                    f"{weights_file}: {key} has shape {tuple(value.shape)} but this config expects "
                    f"{tuple(own[key].shape)}; the adapter and its config.json do not belong together"
                )
        bad = sorted(k for k, v in tensors.items() if not all_finite(v))
        if bad:
            raise ValueError(
                f"{weights_file}: {bad} hold NaN or infinite values: the file is corrupt or the heads diverged before "
                "it was saved. Load an earlier checkpoint, or save the adapter again."
            )
        # assign: the tensors read from the file become the parameters, no second copy; head by head, the backbone's
        # modules not walked
        for name, module in self.named_children():
            prefix = f"{name}."
            part = {k.removeprefix(prefix): v.to(dtype=own[k].dtype, device=own[k].device)
                    for k, v in tensors.items() if k.startswith(prefix)}
            if part and prefix not in BASE_PREFIXES:
                module.load_state_dict(part, assign=True)
