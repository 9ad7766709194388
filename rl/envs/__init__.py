"""Multi-turn environments: the model's turn in, an observation, a reward and done out (rl/envs/base.py)."""
