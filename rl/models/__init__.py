"""The models beside the policy: the frozen reference and PPO's critic."""
