"""`python recipes/prepare_demo_base.py ...` is `causalqwen prepare-base ...`: the code is
causalqwen_adapter/cli/prepare_base.py, and `--help` lists the options."""

from causalqwen_adapter.cli.prepare_base import main

if __name__ == "__main__":
    main()
