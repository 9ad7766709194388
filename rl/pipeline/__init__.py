"""One-step-off asynchronous RL: disjoint rollout and trainer ranks (docs/async.md)."""
