"""A step's rows split into the update's mini-batches (one optimizer step each) by global row id.

The split depends only on global row ids, so it is the same whatever the DP layout, and every rank
gets the same number of rows per mini-batch (no rank waits in an FSDP collective for another). The
micro-batches inside a mini-batch: rl/update/micro_batches.py, rl/update/shared_layout.py.
"""

from __future__ import annotations

import torch

from parallel.dims import derive_seed
from rl.config import RLConfig


def mini_batches(cfg: RLConfig, row_ids: torch.Tensor, step: int, epoch: int, device) -> list[torch.Tensor]:
    """Local row indices (on `device`) of each of the `algo.mini_batches` mini-batches of this rank's rows,
    whose global ids are `row_ids` [B] (on the CPU): within each prompt's group the samples are shuffled
    (keyed by seed, step, epoch, prompt), then global position p goes to mini-batch p mod n.
    `algo.group_mini_batches`: whole prompt groups instead, global prompt id mod n (each rank's prompts
    are contiguous, so each gets the same count when n divides them)."""
    n, G = cfg.algo.mini_batches, cfg.rollout.group_size
    if n == 1:
        return [torch.arange(row_ids.numel(), device=device)]
    if row_ids.numel() % n:
        raise ValueError(f"algo.mini_batches={n} must divide the {row_ids.numel()} rows each DP rank holds")
    if cfg.algo.group_mini_batches:  # whole prompt groups: global prompt id mod n
        if (row_ids.numel() // G) % n:
            raise ValueError(f"algo.group_mini_batches: algo.mini_batches={n} must divide the "
                             f"{row_ids.numel() // G} prompts each DP rank holds")
        mb = (row_ids // G) % n
        return [torch.nonzero(mb == k).flatten().to(device) for k in range(n)]
    pos, perms = [], {}
    for rid in row_ids.tolist():
        prompt, j = divmod(rid, G)
        if prompt not in perms:  # one permutation per prompt, not per row
            # the key as first defined (runs stay bit-compatible with earlier ones); it repeats once prompts
            # reach 131 per step or epochs 61
            key = derive_seed(cfg.train.seed, step * 7919 + epoch * 131 + prompt)
            perms[prompt] = torch.randperm(G, generator=torch.Generator().manual_seed(key), device="cpu").tolist()
        pos.append(prompt * G + perms[prompt][j])
    mb = torch.tensor(pos, device="cpu") % n
    return [torch.nonzero(mb == k).flatten().to(device) for k in range(n)]
