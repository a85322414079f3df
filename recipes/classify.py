"""`python recipes/classify.py ...` is `causalqwen classify ...`: the code is
causalqwen_adapter/cli/classify.py, and `--help` lists the options."""

from causalqwen_adapter.cli.classify import main

if __name__ == "__main__":
    main()
