"""`python -m pretrain.report`: a table of the runs and plots of their curves (pretrain.tracking.report)."""

import sys

from pretrain.tracking.report import main

if __name__ == "__main__":
    sys.exit(main())
