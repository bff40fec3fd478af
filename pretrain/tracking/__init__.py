"""Following runs: rank 0's W&B run, uploading offline runs (sync), reports and plots from
metrics.jsonl. The login-side commands here import no torch."""
