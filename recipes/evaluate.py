"""`python recipes/evaluate.py ...` is `causalqwen evaluate ...`: the code is
causalqwen_adapter/cli/evaluate.py, and `--help` lists the options."""

from causalqwen_adapter.cli.evaluate import main

if __name__ == "__main__":
    main()
