"""Sequence parallelism's memory, measured by MemTracker at tp=2 against core/runtime/budget.py.

What a forward keeps for backward (MemTracker's tracked bytes after a forward with grad, above the
weights, read once the collectives' threads have let go of their tensors), with parallel.sequence_parallel
off and on, with and without activation checkpointing: SP removes (1 - 1/tp) of the RMSNorms' saved
activations and of the column-parallel layers' saved inputs (and of the checkpointed block inputs), as the
budget's "sequence activations" part says, and the budget's activations are within 10% of the measurement."""

from __future__ import annotations

import pytest
import torch

from core.config import ModelConfig
from core.model import build_model
from core.runtime.budget import Batch, Layout, step_budget
from core.runtime.budget_seq import other_act, seq_act
from parallel.dims import ParallelDims, init_parallel, kv_replica_group
from parallel.fsdp import apply_activation_checkpointing
from tests.memory import settled_current_bytes

CFG = ModelConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=176,
                  max_seq_len=128)
ROWS, S, TP = 8, 64, 2


def _kept_after_forward(sp: bool, ac: bool) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    state = init_parallel(ParallelDims(1, TP), "cpu", CFG.n_heads, CFG.n_kv_heads)
    model = build_model(CFG, state.tp_group, kv_replica_group(state, CFG.n_kv_heads), seed=1)
    if ac:
        apply_activation_checkpointing(model.layers)
    model.sequence_parallel = sp
    ids = torch.randint(0, CFG.vocab_size, (ROWS, S), generator=torch.Generator().manual_seed(0))
    mt = MemTracker()
    mt.track_external(model)
    with mt:
        base = sum(d["Total"] for d in mt.get_tracker_snapshot("current").values())
        out = model(ids, head=lambda h, w: h.sum())
        kept = settled_current_bytes(mt, state.tp_group) - base
        out.backward()
    return kept


def _budget(sp: bool, ac: bool) -> dict:
    lay = Layout(tp=TP, sp=sp, activation_checkpointing=ac)
    return step_budget(CFG, lay, Batch(rollout_rows=0, update_rows=ROWS, seq_len=S, response_len=S))["parts"]


@pytest.mark.slow
@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_sp_cuts_sequence_activations_to_one_over_tp(dist_pools, ac):
    off = dist_pools.run(TP, _kept_after_forward, False, ac)[0]
    on = dist_pools.run(TP, _kept_after_forward, True, ac)[0]
    b_off, b_on = _budget(False, ac), _budget(True, ac)
    assert b_on["sequence activations"] * TP == b_off["sequence activations"]
    assert b_on["activations"] == b_off["activations"]
    # with checkpointing, one layer's set exists only while backward recomputes it (the budget's peak counts it):
    # what stays after forward is the budget's parts without that layer
    recompute = {sp: (other_act(CFG, TP) + seq_act(CFG, TP, sp)) * ROWS * S * 4 if ac else 0 for sp in (False, True)}
    saved = off - on
    want = b_off["sequence activations"] - b_on["sequence activations"] - (recompute[False] - recompute[True])
    assert abs(saved - want) <= 0.10 * want, (saved, want)
    for got, b, sp in ((on, b_on, True), (off, b_off, False)):
        total = b["activations"] + b["sequence activations"] - recompute[sp]
        assert abs(got - total) <= 0.10 * got, (got, total)
