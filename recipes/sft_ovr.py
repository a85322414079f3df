"""`python recipes/sft_ovr.py ...` (or under `accelerate launch`/`torchrun`) is `causalqwen train ...`: the code is
causalqwen_adapter/cli/train.py, and `--help` lists the options."""

from causalqwen_adapter.cli.train import main

if __name__ == "__main__":
    main()
