"""The `causalqwen` command line (TRL's `trl` scripts, for causal heads): one module per subcommand, each with a
`main(argv)` that `causalqwen <subcommand>`, `python -m causalqwen_adapter.cli <subcommand>` and the thin
`recipes/*.py` all call. `main.py` dispatches; nothing here imports trl or datasets until a subcommand needs them."""
