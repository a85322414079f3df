"""`python recipes/generate.py ...` is `causalqwen generate ...`: the code is
causalqwen_adapter/cli/generate.py, and `--help` lists the options."""

from causalqwen_adapter.cli.generate import main

if __name__ == "__main__":
    main()
