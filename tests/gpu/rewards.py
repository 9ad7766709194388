"""Dense plug-in rewards for GPU checks on randomly initialised models (which never answer a
task correctly, so an exact-match reward would be 0 everywhere and GRPO's advantages all 0)."""


def digit_share(meta: dict, response: str) -> float:
    """The share of the response's characters that are digits, in [0, 1] (0 for an empty one)."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0
