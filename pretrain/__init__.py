"""pretrain: LLM pretraining on Slurm clusters.

The core (config, compose, rundir, flops, redaction) imports no torch; on it stand three wings:
launcher (login node: launch, plan, status), trainer (the job) with parallel and models, and
tracking (W&B, sync, report). tests/test_structure.py keeps the imports that way.
"""
