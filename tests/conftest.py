import os

# Keep every test off the network and away from a user's W&B account.
os.environ.setdefault("WANDB_MODE", "disabled")
