"""`python recipes/push_to_hub.py ...` is `causalqwen push ...`: the code is
causalqwen_adapter/cli/push.py, and `--help` lists the options."""

from causalqwen_adapter.cli.push import main

if __name__ == "__main__":
    main()
