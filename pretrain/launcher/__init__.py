"""The login-node wing: compose, check and plan a run, then train it here or submit it to Slurm.

Imports no torch (nor the trainer): `python -m pretrain.launch` answers in well under a second on
a login node. What only the trainer's torch can tell (the GPUs of this machine, FP8 support) comes
from a probe in a process of its own (pretrain.trainer.devices), for local runs only.
"""
