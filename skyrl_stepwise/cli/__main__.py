"""`python -m skyrl_stepwise.cli <command>`: the same as `skyrl-stepwise <command>` (no install of the script needed)."""

import sys

from skyrl_stepwise.cli import main

sys.exit(main())
