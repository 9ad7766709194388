"""core/runtime/budget.py's reference part with an EMA-synced bf16 reference: the fp32 master copy that
rl/models/reference.py keeps is projected as the bytes it really allocates (summed over its tensors after an
EMA sync), and absent for a hard-synced or an fp32 reference."""

import torch

from core.config import ModelConfig
from core.model import build_model
from core.runtime.budget import Layout, reference_bytes
from rl.config import ReferenceConfig
from rl.models.reference import ReferenceSync

CFG = ModelConfig(vocab_size=128, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64)


def _master_bytes(mode: str, dtype: torch.dtype) -> int:
    pol = build_model(CFG, seed=1)
    ref = build_model(CFG, seed=2).to(dtype)
    sync = ReferenceSync(ReferenceConfig(sync_every=1, sync_mode=mode), kl_target=0.1)
    sync.maybe_sync(0, 1.0, pol, ref)
    return sum(t.numel() * t.element_size() for t in sync.master.values())


def test_ema_master_copy_is_projected_as_allocated():
    lay = Layout()
    plain, _ = reference_bytes("tp", CFG, lay, 2)
    with_master, _ = reference_bytes("tp", CFG, lay, 2, ema_master=True)
    assert with_master - plain == _master_bytes("ema", torch.bfloat16) > 0
    assert _master_bytes("hard", torch.bfloat16) == 0 and _master_bytes("ema", torch.float32) == 0
    assert reference_bytes("tp", CFG, lay, 4, ema_master=True) == reference_bytes("tp", CFG, lay, 4)
    # sharded like the reference: over dp with FSDP; on the host with cpu_offload
    fsdp = Layout(dp=4)
    assert (reference_bytes("tp_fsdp", CFG, fsdp, 2, True)[0] - reference_bytes("tp_fsdp", CFG, fsdp, 2)[0]
            == -(-(with_master - plain) // 4 // 4) * 4)
    assert reference_bytes("cpu_offload", CFG, lay, 2, True) == reference_bytes("cpu_offload", CFG, lay, 2)
