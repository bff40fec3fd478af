"""`python -m pretrain.generate`: continue a prompt with a run's checkpoint or an exported folder (pretrain.hf.generate)."""

import sys

from pretrain.hf.generate import main

if __name__ == "__main__":
    sys.exit(main())
