"""`python -m pretrain.train`: one rank of a job, on a run directory the launcher wrote (pretrain.trainer.loop)."""

import sys

from pretrain.trainer.loop import main

if __name__ == "__main__":
    sys.exit(main())
