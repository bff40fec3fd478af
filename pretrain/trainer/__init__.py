"""The job wing: what every process of a training job runs (`python -m pretrain.train RUN_DIR`).

It reads the run directory the launcher wrote and never composes configs or submits jobs.
"""
