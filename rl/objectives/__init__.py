"""What the RL update minimises: KL estimators, clipped policy/value losses, advantages, and the
controllers of the KL and entropy coefficients."""
