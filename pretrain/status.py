"""`python -m pretrain.status`: this user's runs, their Slurm jobs and their progress (pretrain.launcher.status)."""

import sys

from pretrain.launcher.status import main

if __name__ == "__main__":
    sys.exit(main())
