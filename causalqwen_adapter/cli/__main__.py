"""`python -m causalqwen_adapter.cli <subcommand> ...`, the same as the `causalqwen` console script."""

import sys

from .main import main

sys.exit(main())
