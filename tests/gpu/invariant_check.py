"""Batch-invariant mode on the accelerator (scripts/gpu_check.sh's "invariant" section):
    python -m tests.gpu.invariant_check [--cpu] [--json OUT]

On the device (CUDA when there is one, else the CPU), for fp32 and bf16 compute, a model of Llama's layout with
grouped KV heads samples skewed-length responses (a fifth of the vocabulary ends a row, so rows finish early and
the batch compacts) with `generate(record_hidden=True)`, and the trainer's paths recompute the response tokens:
  1. the rollout's recorded final hidden states equal the trainer's full forward's (padded rows, and the
     shared-prompt layout) bit for bit, and the fused head on them gives the trainer's log-probs bit for bit:
     max |log pi_rollout - log pi_train| = 0;
  2. the exact full-vocabulary KL(rollout || train) per token, by the fused head over the recorded hidden
     states: exactly 0;
  3. the mode off in bf16: the same comparison's max |diff| and KL (not 0 on the accelerators tried: the
     check that 1-2 could fail);
  4. time of generation + one trainer forward, mode on over mode off (same model, alternating).
`--cpu`: a tiny model (seconds). Writes {device, checks: [{name, ok, detail}], off_bf16, timing} to --json; exit
status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from core.config import ModelConfig
from core.generation.generate import generate
from core.model import build_model
from rl.update.logprobs import policy_token_stats, reference_hidden, stats_from_hidden
from rl.update.shared_layout import share_rollout

TEMP = 0.9


def _shape(cpu: bool) -> ModelConfig:
    if cpu:
        return ModelConfig(vocab_size=131, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                           max_seq_len=96, tie_embeddings=False)
    return ModelConfig(vocab_size=32000, hidden_size=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                       intermediate_size=2816, max_seq_len=1024, tie_embeddings=False)


def _rollout(model, mc: ModelConfig, rows: int, new: int, device):
    """Left-padded prompts of several lengths (two rows share one prompt), sampled to at most `new` tokens."""
    g = torch.Generator().manual_seed(0)
    lens = [3 + (7 * i) % 13 for i in range(rows)]
    P = max(lens)
    ids = torch.zeros(rows, P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, P - n:] = torch.randint(8, mc.vocab_size, (n,), generator=g)
        mask[i, P - n:] = 1
    ids[1], mask[1] = ids[0], mask[0]
    stops = list(range(mc.vocab_size - mc.vocab_size // 5, mc.vocab_size))
    out = generate(model, ids.to(device), mask.to(device), max_new_tokens=new, eos_id=None, eos_ids=stops, pad_id=0,
                   temperature=TEMP, seed=5, vocab_limit=mc.vocab_size, record=True, record_hidden=True,
                   share_prefill=True)
    return out


def _compare(model, mc: ModelConfig, out) -> dict:
    """max |hidden diff|, max |log-prob diff| (padded and shared layouts) and the exact KL(rollout || train)."""
    from rl.experience.rollout import Rollout

    m = out.response_mask.bool()
    B = m.shape[0]
    ro = Rollout(out.sequences, out.attention_mask, m, out.prompt_len, torch.zeros(B, device=m.device),
                 torch.arange(B, device=m.device), [], [])
    kw = dict(vocab_size=mc.vocab_size, temperature=TEMP, entropy=False)
    with torch.no_grad():
        h, _ = reference_hidden(model, ro.sequences, ro.attention_mask, ro.prompt_len)
        targets = ro.sequences[:, ro.prompt_len:]
        dh = (h.float() - out.hidden.float()).abs().where(m[..., None], 0.0).max().item()
        rec = stats_from_hidden(model, out.hidden, targets, mask=m, **kw).logprobs.float()
        res = {"hidden_max_abs_diff": dh, "tokens": int(m.sum())}
        for name, packed in (("padded", None), ("shared", share_rollout(ro))):
            st = policy_token_stats(model, ro.sequences, ro.attention_mask, ro.prompt_len, mask=m, packed=packed,
                                    rollout_hidden=out.hidden, **kw)
            res[f"logp_max_abs_diff_{name}"] = (st.logprobs.float() - rec).abs().where(m, 0.0).max().item()
            kl = st.rollout_kl.float().where(m, 0.0)
            res[f"rollout_kl_max_{name}"] = kl.abs().max().item()
            res[f"rollout_kl_mean_{name}"] = (kl.sum() / m.sum().clamp(min=1)).item()
    return res


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(cpu: bool) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    mc = _shape(cpu)
    rows, new = (6, 10) if cpu else (32, 256)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "rows": rows,
              "max_new_tokens": new, "checks": [], "timing": {}}
    for precision in ("fp32", "bf16"):
        model = build_model(mc, None, seed=3, device=device)
        model.set_mixed_precision(precision)
        times = {}
        for i, on in enumerate((False, True, False, True)):  # alternating: the second of each is the one kept
            model.batch_invariant = on
            _sync(device)
            t0 = time.perf_counter()
            try:
                out = _rollout(model, mc, rows, new, device)
                res = _compare(model, mc, out)
            except Exception:  # noqa: BLE001 - reported as a failed check
                report["checks"].append(dict(name=f"{precision} mode {'on' if on else 'off'}", ok=False,
                                             detail=traceback.format_exc(limit=4)))
                break
            _sync(device)
            times[on] = time.perf_counter() - t0
            if i < 2:  # warm-up
                continue
            if on:
                exact = all(res[k] == 0.0 for k in ("hidden_max_abs_diff", "logp_max_abs_diff_padded",
                                                    "logp_max_abs_diff_shared", "rollout_kl_max_padded",
                                                    "rollout_kl_max_shared"))
                lens = out.response_mask.sum(1)
                skewed = int(lens.min()) < new and len(set(lens.tolist())) > 2
                report["checks"].append(dict(name=f"{precision} rollout == trainer (padded, shared)",
                                             ok=exact and skewed, detail=json.dumps(res)))
            elif precision == "bf16":
                report["off_bf16"] = res
        if times.keys() == {False, True}:
            report["timing"][precision] = {"off_s": times[False], "on_s": times[True],
                                           "on_over_off": times[True] / times[False]}
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the tiny version on the CPU")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    rep = run(a.cpu)
    for c in rep["checks"]:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['name']}" + ("" if c["ok"] else f"\n{c['detail']}"))
    print(f"mode off, bf16: {json.dumps(rep.get('off_bf16'))}")
    print(f"timing: {json.dumps(rep['timing'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if rep["checks"] and all(c["ok"] for c in rep["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
