"""`python recipes/distill_heads.py ...` (or under `accelerate launch`/`torchrun`) is `causalqwen distill ...`: the code is
causalqwen_adapter/cli/distill.py, and `--help` lists the options."""

from causalqwen_adapter.cli.distill import main

if __name__ == "__main__":
    main()
