"""`python -m pretrain.data.prepare`: a corpus into a prepared dataset, on this machine or as a Slurm job array.

The command lives with the launcher (pretrain.launcher.dataprep), which submits job arrays as it
submits training; the work itself is pretrain.data.build's.
"""

import sys

from pretrain.launcher.dataprep import main

if __name__ == "__main__":
    sys.exit(main())
