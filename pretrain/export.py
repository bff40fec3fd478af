"""`python -m pretrain.export`: a run's checkpoint as a Hugging Face Llama folder (pretrain.hf.export)."""

import sys

from pretrain.hf.export import main

if __name__ == "__main__":
    sys.exit(main())
