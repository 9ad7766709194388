"""The step's experience and update: what the update needs of the rollouts (reference and old passes, KL,
advantages), mini- and micro-batches, the shared-prompt layout, per-token log-probs, the update itself
and its statistics."""
