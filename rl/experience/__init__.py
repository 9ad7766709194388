"""Where a step's experience comes from: prompt data sets, built-in tasks, rollouts (sampling
and scoring) and reward functions."""
