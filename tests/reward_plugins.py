"""Reward plug-ins for the tests, in a module the reward worker imports without torch (fast start)."""

import re

HANG = "hang-here"


def plugin_hangs(meta, response):
    """Catastrophic regex backtracking: minutes inside C, deaf to SIGTERM and SIGALRM (as a symbolic
    checker raising 10 to the 10^10 is), no memory."""
    if HANG in response:
        re.match(r"(a+)+$", "a" * 64 + "b")
    return 1.0


def plugin_prints(meta, response):
    print("a plug-in that prints must not break the worker's pipe")
    return 0.5


def plugin_hangs_on_rank_1(meta, response):
    """Hangs (in C, as plugin_hangs) on every call made by rank 1 of a launch; 1.0 elsewhere."""
    import os

    if os.environ.get("RANK") == "1":
        re.match(r"(a+)+$", "a" * 64 + "b")
    return 1.0


# dense and sparse rewards the trainer tests score with (an untrained model already varies on them)


def digits_over_5(meta, response):
    """The count of digits in the response over 5."""
    return sum(c.isdigit() for c in response) / 5.0


def digits_over_6(meta, response):
    """The count of digits in the response over 6 (the share of a 6-token response's characters, about)."""
    return sum(c.isdigit() for c in response) / 6.0


def digits_over_9(meta, response):
    """The count of digits in the response over 9."""
    return sum(c.isdigit() for c in response) / 9.0


def sevens(meta, response):
    """A sparse 0/1 reward: many groups of an untrained policy score all 0, which dynamic sampling drops."""
    return float("7" in response)


def nan_on_prompts_from_1(meta, response):
    """NaN for the prompts that start with "1", else 0."""
    return float("nan") if meta["prompt"].startswith("1") else 0.0
