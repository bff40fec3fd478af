"""`python -m pretrain.sync`: upload offline W&B runs (from a machine with internet) (pretrain.tracking.sync)."""

import sys

from pretrain.tracking.sync import main

if __name__ == "__main__":
    sys.exit(main())
