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
