r"""`causalqwen generate`: stream a CausalQwen adapter's answer to the terminal.

    causalqwen generate --model_name_or_path my-causal-adapter \
        --prompt "Write a function that reverses a string." --inference_mode standard

The model is an adapter folder or Hub id; its tokenizer is the base's (adapters carry none), whose chat template is
applied when it has one (`--no_chat` to feed the prompt raw). With a numeric adapter (docs/design.md, Numbers) the
numbers of the prompt enter as <NUM> tokens with their values, and the answer is printed once done, each generated
<NUM> written as its predicted value; `--interval 0.9` adds a line per generated number with its central 90 %
interval (the Cauchy law of its value), on `--value_range LOW HIGH` when the numbers are known to lie there.
The model runs on `--device` (default `auto`: CUDA if available, else MPS, else the CPU).
"""

import argparse

import torch
from transformers import AutoTokenizer, TextStreamer

from causalqwen_adapter import CausalQwenConfig, CausalQwenForCausalLM
from causalqwen_adapter.adapter_io import ADAPTER_HINT, check_found
from causalqwen_adapter.cauchy import INFERENCE_MODES, cauchy_interval
from causalqwen_adapter.configuration_causalqwen import check_number
from causalqwen_adapter.devices import add_device_argument, resolve_device
from causalqwen_adapter.numeric import add_num_token, decode_with_numbers, encode_with_numbers

from .parsing import CliArgumentParser

# old spellings, read as the current ones (dashed spellings of every flag are read too)
ALIASES = {"--mode": "--inference_mode"}


def build_inputs(tokenizer, prompt: str, chat: bool):
    if chat and tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def make_parser(prog: str | None = None) -> CliArgumentParser:
    parser = CliArgumentParser(prog=prog, description=__doc__, aliases=ALIASES,
                               usage="%(prog)s --model_name_or_path ADAPTER --prompt TEXT [options]")
    parser.add_argument("adapter", nargs="?", default=None, help=argparse.SUPPRESS)  # the old positional
    parser.add_argument("--model_name_or_path", default=None, help="adapter folder or Hub id (required)")
    parser.add_argument("--prompt", required=True, help="the text the model answers (or continues, with --no_chat)")
    parser.add_argument("--inference_mode", choices=INFERENCE_MODES, default=None,
                        help="default: the adapter's config")
    parser.add_argument("--causal_temperature", type=float, default=None, help="T of the mode's noise")
    parser.add_argument("--noise_sharing", choices=("step", "sequence"), default=None, help="sampling mode only")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--do_sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--base_model", default=None, help="override the base named in the adapter")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--no_chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--interval", type=float, default=None, metavar="LEVEL",
                        help="numeric adapters: also print each generated number's central LEVEL interval (e.g. 0.9)")
    parser.add_argument("--value_range", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                        help="with --interval: the range the numbers are known to lie in (their law truncated to it)")
    parser.add_argument("--decimal_comma", action="store_true",
                        help="numeric adapters: read the prompt's numbers as written with decimal commas (3,5 is 3.5, "
                             "1.000 is 1000; docs/numbers.md)")
    add_device_argument(parser)
    return parser


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    if args.adapter is not None and args.model_name_or_path is not None:
        parser.error(f"the adapter is given twice ({args.adapter!r} and --model_name_or_path "
                     f"{args.model_name_or_path!r}): give --model_name_or_path alone")
    args.model_name_or_path = args.model_name_or_path or args.adapter
    del args.adapter
    if args.model_name_or_path is None:
        parser.error("the following arguments are required: --model_name_or_path")
    if not args.prompt.strip():
        parser.error("--prompt is empty: give the text the model should answer or continue")
    try:  # before loading: a wrong argument fails at once
        device = resolve_device(args.device)
        check_found(args.model_name_or_path, "--model_name_or_path", ADAPTER_HINT)
        if args.causal_temperature is not None:
            check_number("--causal_temperature", args.causal_temperature, minimum=0)
        check_number("--max_new_tokens", args.max_new_tokens, minimum=1, integer=True)
        if args.interval is not None and not 0 < check_number("--interval", args.interval) < 1:
            raise ValueError(f"--interval is the interval's level, in (0, 1) (0.9 for 90 %), got {args.interval}")
        if args.value_range is not None:
            if args.interval is None:
                raise ValueError("--value_range reads the numbers' intervals: give --interval LEVEL with it")
            low, high = (check_number("--value_range", v) for v in args.value_range)
            if not low < high:
                raise ValueError(f"--value_range is LOW HIGH with LOW < HIGH, got {low:g} {high:g}")
        if args.interval is not None and not CausalQwenConfig.from_pretrained(args.model_name_or_path).numeric:
            raise ValueError(f"--interval reads the numbers of a numeric adapter (config.numeric), and "
                             f"{args.model_name_or_path} is not one")
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    args.device = device
    return args


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    run(parse_args(argv, prog))


def run(args: argparse.Namespace) -> None:
    """Generate as `args` (parsed and checked by `parse_args`) asks."""
    device = args.device
    if args.seed is not None:
        torch.manual_seed(args.seed)
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = CausalQwenForCausalLM.from_pretrained(args.model_name_or_path, base_model=args.base_model, dtype=dtype)
    model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.base_model or model.config.base_model_name_or_path)
    inputs = build_inputs(tokenizer, args.prompt, chat=not args.no_chat).to(device)
    options = {
        "inference_mode": args.inference_mode,
        "causal_temperature": args.causal_temperature,
        "noise_sharing": args.noise_sharing,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
    }
    options = {k: v for k, v in options.items() if v is not None}
    if model.config.numeric:
        print(generate_with_numbers(model, tokenizer, args.prompt, not args.no_chat, args, options))
        return
    model.generate(
        **inputs,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
        **options,
    )


def generate_with_numbers(model, tokenizer, prompt: str, chat: bool, args, options) -> str:
    num_id = model.config.num_token_id
    add_num_token(tokenizer, num_id)
    if chat and tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    encoded = encode_with_numbers(tokenizer, prompt, num_id, decimal_comma=args.decimal_comma)
    out = model.generate(
        torch.tensor([encoded["input_ids"]], device=model.device),
        numeric_values=torch.tensor([encoded["numeric_values"]], device=model.device),
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        return_dict_in_generate=True,
        **options,
    )
    start = len(encoded["input_ids"])
    tokens, values = out.sequences[0, start:].cpu(), out.numeric_values[0, start:].cpu()
    text = decode_with_numbers(tokenizer, tokens, values, num_id)
    if args.interval is None:
        return text
    is_number = tokens == num_id
    lower, upper = cauchy_interval(values[is_number], out.numeric_scales[0, start:].cpu()[is_number], args.interval,
                                   support=None if args.value_range is None else tuple(args.value_range))
    lines = [f"number {i}: {v:g}, {args.interval * 100:g} % interval [{lo:g}, {hi:g}]"
             for i, (v, lo, hi) in enumerate(zip(values[is_number].tolist(), lower.tolist(), upper.tolist()), 1)]
    return "\n".join([text, *lines])


if __name__ == "__main__":
    main()
