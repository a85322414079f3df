"""`python recipes/extract_features.py ...` (or under `accelerate launch`/`torchrun`) is `causalqwen extract-features ...`: the code is
causalqwen_adapter/cli/extract_features.py, and `--help` lists the options."""

from causalqwen_adapter.cli.extract_features import main

if __name__ == "__main__":
    main()
