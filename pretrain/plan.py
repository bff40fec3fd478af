"""`python -m pretrain.plan`: will this run fit on its GPUs, and how long will it take? (pretrain.launcher.cli)."""

import sys

from pretrain.launcher.cli import plan_main as main

if __name__ == "__main__":
    sys.exit(main())
