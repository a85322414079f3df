"""Generation glue of CausalQwenForCausalLM: the CausalQwen options of `generate()` (inference mode, temperature,
noise sharing), the individual shared across the steps of an answer, and the values of `<NUM>` tokens fed back
step by step (docs/design.md, Inference modes and Numbers).

Shipped as remote code: imports only torch and transformers (through the model it is mixed into).
"""

import warnings

import torch

from .heads import check_numeric_values

# The CausalQwen options of generate(), carried in the generation loop's model kwargs to every forward.
GENERATE_OPTIONS = ("inference_mode", "causal_temperature", "noise_sharing", "causal_noise", "numeric_values",
                    "numeric_record")


class CausalGenerationMixin:
    """Mixed into `CausalQwenForCausalLM` ahead of transformers' `GenerationMixin`, whose hooks it extends."""

    def prepare_inputs_for_generation(self, input_ids, *args, inputs_embeds=None, numeric_values=None,
                                      numeric_record=None, **kwargs):
        # `inputs_embeds` named here: generate() accepts a prompt as embeddings only from models that say so.
        model_inputs = super().prepare_inputs_for_generation(input_ids, *args, inputs_embeds=inputs_embeds, **kwargs)
        if numeric_values is not None:
            # The values of the positions fed this step; one counts only where its token is <NUM> (generated
            # columns hold each step's loc_Y, whatever token was chosen).
            fed = model_inputs.get("input_ids")
            width = fed.shape[1] if fed is not None else model_inputs["inputs_embeds"].shape[1]
            length = input_ids.shape[1]
            tokens, values = input_ids[:, length - width :], numeric_values[:, length - width : length]
            model_inputs["numeric_values"] = torch.where(tokens == self.config.num_token_id, values, 0.0)
        return model_inputs

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate` plus the CausalQwen options, checked once per call:
        `inference_mode`, `causal_temperature` (T ≥ 0) and, for `sampling`, `noise_sharing`.

        Numeric models (docs/design.md, Numbers) take `numeric_values` beside the prompt (0 where a token is not `<NUM>`; zeros
        when omitted), feed each generated `<NUM>` its predicted value loc_Y, and with `return_dict_in_generate=True`
        return `numeric_values` [batch, length] (the value of every `<NUM>` of the sequences, 0 elsewhere) and
        `numeric_scales` (scale_Y of every generated `<NUM>`: its Cauchy law is (value, scale), whose intervals
        `cauchy.cauchy_interval` gives; 0 elsewhere, the prompt's numbers included).
        """
        mode, _ = self._resolve_mode(
            kwargs.get("inference_mode"), kwargs.get("causal_temperature"), kwargs.get("noise_sharing", "step")
        )
        prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        if torch.is_tensor(prompt) and prompt.shape[-1] == 0 and kwargs.get("inputs_embeds") is None:
            raise ValueError(f"the prompt has no tokens (input_ids of shape {tuple(prompt.shape)}): pass at least one "
                             "token, e.g. the tokenizer's bos or a chat template's header")
        ignored = []
        if kwargs.get("causal_temperature") is not None and mode in ("compatible", "causal"):
            ignored.append("causal_temperature")
        ignored += [k for k in ("noise_sharing", "causal_noise") if kwargs.get(k) is not None and mode != "sampling"]
        if ignored:
            warnings.warn(
                f"inference_mode={mode!r} ignores {', '.join(ignored)} (causal_temperature applies to 'standard' "
                "and 'sampling', noise_sharing/causal_noise to 'sampling')",
                UserWarning,
                stacklevel=2,
            )
        if self.config.numeric:
            return self._generate_with_numbers(super().generate, *args, **kwargs)
        return super().generate(*args, **kwargs)

    def _generate_with_numbers(self, generate, inputs=None, generation_config=None, **kwargs):
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if input_ids is None:
            raise ValueError("numeric generation needs the prompt as input_ids (inputs_embeds cannot carry <NUM> values)")
        config = generation_config if generation_config is not None else self.generation_config
        if (kwargs.get("num_beams") or config.num_beams or 1) != 1:
            raise ValueError("numeric models generate with num_beams=1 (greedy or sampling): beams would reorder "
                             "the sequences without their <NUM> values")
        if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
            raise ValueError("numeric models generate without assistant_model or prompt_lookup_num_tokens: draft "
                             "tokens would come without their <NUM> values")
        values = kwargs.pop("numeric_values", None)
        if values is None:
            values = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        values = check_numeric_values(values, input_ids.shape, "input_ids", input_ids, self.config.num_token_id)
        # This call's values, grown step by step in the generation loop's model kwargs (which generate() does not
        # return): a per-call record, so concurrent calls on one model do not mix.
        record = {"values": values}
        out = generate(inputs, generation_config, numeric_values=values, numeric_record=record, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        generated = record["values"]
        if not isinstance(out, torch.Tensor):
            is_number = sequences == self.config.num_token_id
            out["numeric_values"] = torch.where(is_number, generated[:, : sequences.shape[1]], 0.0)
            scales = record.get("scales")
            scales = torch.zeros_like(generated) if scales is None else scales  # None when no step ran
            out["numeric_scales"] = torch.where(is_number, scales[:, : sequences.shape[1]], 0.0)
        return out

    def _get_candidate_generator(self, *args, **kwargs):
        # Assisted decoding hands the loop's model kwargs to the assistant's generate(), which would refuse this
        # model's options: the options score this model's tokens; the assistant drafts with its own defaults.
        if isinstance(kwargs.get("model_kwargs"), dict):
            kwargs["model_kwargs"] = {k: v for k, v in kwargs["model_kwargs"].items() if k not in GENERATE_OPTIONS}
        return super()._get_candidate_generator(*args, **kwargs)

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        if model_kwargs.get("noise_sharing") == "sequence" and outputs.causal_noise is not None:
            model_kwargs["causal_noise"] = outputs.causal_noise  # the same individual for the whole answer
        if model_kwargs.get("numeric_values") is not None and outputs.loc_Y is not None:
            # The value of the token just chosen, should it be <NUM>; masked by token when fed back.
            values = model_kwargs["numeric_values"]
            model_kwargs["numeric_values"] = torch.cat([values, outputs.loc_Y[:, -1:].to(values)], dim=1)
            record = model_kwargs.get("numeric_record")
            if record is not None:
                # the scale of that value beside it (the prompt's columns 0): generate() returns both
                scales = record.get("scales")
                if scales is None:  # the first step
                    scales = torch.zeros_like(values)
                record["values"] = model_kwargs["numeric_values"]
                record["scales"] = torch.cat([scales, outputs.scale_Y[:, -1:].to(values)], dim=1)
        return model_kwargs
