"""The update's machinery: micro-batches, the shared-prompt layout, per-token log-probs and the
statistics of one update."""
