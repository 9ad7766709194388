"""HF parity on the check's device: tools/convert_hf imports random Llama-3 (llama3 RoPE), Qwen2
(qkv bias, tied) and Mistral checkpoints made with transformers; kltron's logits on the device,
at tp = world size, equal transformers' logits computed on the same device (fp32, TF32 off,
atol = rtol = 1e-4, as tests/test_convert_hf.py on CPU).

    torchrun --standalone --nproc_per_node N -m tests.gpu.hf_parity [--json OUT]   # NCCL
    python -m tests.gpu.hf_parity --cpu [--json OUT]                              # gloo, 1 process
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def _device(cpu: bool) -> torch.device:
    if cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    if "RANK" in os.environ and not dist.is_initialized():  # under torchrun: NCCL, even on one GPU
        dist.init_process_group("nccl", device_id=dev)
    return dev


def check_kind(kind: str, root: str, device, world: int, rank: int) -> float:
    from core.ckpt import load_model_weights, read_manifest
    from core.config import ModelConfig, from_dict
    from core.model import Transformer
    from parallel.comm import all_gather_along
    from parallel.dims import ParallelDims, init_parallel
    from tests.test_convert_hf import IDS, make_hf
    from tools.convert_hf import import_hf

    hf_dir, ckpt = os.path.join(root, f"{kind}_hf"), os.path.join(root, f"{kind}_kl")
    if rank == 0:
        make_hf(kind, hf_dir)
        import_hf(hf_dir, ckpt, ignore_sliding_window=kind == "mistral")
    state = init_parallel(ParallelDims(1, world), device)
    if world > 1:
        dist.barrier()  # rank 0 has written the checkpoint
    import transformers

    seq = 8 if kind == "mistral" else 24  # mistral: within its sliding window
    ids = IDS[:, :seq].to(device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().to(device).eval()
    cfg = from_dict(ModelConfig, read_manifest(ckpt)["model_config"])
    model = Transformer(cfg, state.tp_group, device="meta").to_empty(device=device)
    load_model_weights(model, ckpt, state)
    with torch.no_grad():
        want = hf(ids).logits
        got = all_gather_along(model(ids), -1, state.tp_group)[..., :cfg.vocab_size]  # check only: whole vocab
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    return float((got - want).abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = _device(args.cpu)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    res, failed = {"device": str(device), "world": world, "tp": world, "kinds": {}}, 0
    with tempfile.TemporaryDirectory(prefix="kltron_hf_parity_") as root:
        if world > 1:  # every rank writes into rank 0's directory
            from parallel.dims import ParallelDims, init_parallel

            init_parallel(ParallelDims(1, world), device)
            box = [root]
            dist.broadcast_object_list(box, 0)  # rank 0's temporary directory
            root = box[0]
        for kind in ("llama", "qwen2", "mistral"):
            try:
                res["kinds"][kind] = {"ok": True, "max_abs_err": check_kind(kind, root, device, world, rank)}
            except Exception as e:  # noqa: BLE001 - reported, then the next kind runs
                failed += 1
                res["kinds"][kind] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            if rank == 0:
                print(f"[{'PASS' if res['kinds'][kind]['ok'] else 'FAIL'}] hf parity {kind} on {device} "
                      f"tp={world}: {res['kinds'][kind]}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
