"""`python recipes/compare.py ...` is `causalqwen compare ...`: the code is
causalqwen_adapter/cli/compare.py, and `--help` lists the options."""

from causalqwen_adapter.cli.compare import main

if __name__ == "__main__":
    main()
