"""Models out and in: a run's checkpoint as a Hugging Face Llama folder (`python -m pretrain.export`),
Hugging Face weights into a run's model (`model.init_from`), and samples from either
(`python -m pretrain.generate`). On the job side of the house: torch, never the launcher.
"""
