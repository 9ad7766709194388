"""What running reward plug-ins in a worker process (rl.experience.reward_worker) costs: the same rollout of
N prompts x G samples scored in the rank (`reward.timeout_s=0`) and through the worker, side by side
in one process, alternating, best of `--repeat`.

    python -m bench.bench_reward_worker [--fn format] [--prompts 64] [--group 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import time

from rl.experience.rewards import RewardConfig, build_reward, score_responses


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fn", default="format", help="a reward.fns entry (format: cheap, so the round trip shows)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    metas = [{"answer": str(rng.randint(0, 999))} for _ in range(args.prompts)]
    responses = [f"so the answer is \\boxed{{{rng.randint(0, 999)}}}" for _ in range(args.prompts * args.group)]
    fns = {name: build_reward(RewardConfig(task=None, fns=[args.fn], timeout_s=t))[1]
           for name, t in (("in the rank", 0), ("worker", 30))}
    best = {}
    try:
        for fn in fns.values():  # warm-up: imports, the worker's start
            score_responses(fn, metas[:1], responses[:args.group], args.group)
        for _ in range(args.repeat):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                score_responses(fn, metas, responses, args.group)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    finally:
        for fn in fns.values():
            fn.close()
    n = len(responses)
    for name, s in best.items():
        print(f"{name:12s} {s:.4f} s for {n} responses ({s / n * 1e3:.3f} ms each)")
    print(f"worker round trip: {(best['worker'] - best['in the rank']) / n * 1e3:.3f} ms per call")
    return best


if __name__ == "__main__":
    main()
