"""`python -m pretrain.launch`: compose the config, check it, then train here or submit to Slurm (pretrain.launcher.cli)."""

import sys

from pretrain.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
