"""Per-token KL between a policy and a reference checkpoint on fixed token sequences.

    torchrun --nproc_per_node N -m tools.kl_eval --policy C1 --ref C2 --tokens T.jsonl --tp TP --out R.json
    python -m tools.kl_eval --policy C1 --ref C2 --tokens T.jsonl --out R.json        (one process, tp 1)

Each line of T.jsonl is {"tokens": [ids...], "response_start": k} with 1 <= k < len(tokens); token
t >= k is a response token, scored from the distribution predicting it (hidden state t-1). Both
models are loaded at tp (dp = world / tp; the sequences are split over dp, each processed whole),
and the statistics come from the vocab-parallel fused head -- no rank ever holds full-vocabulary
logits:

    logprob      log p(x_t)               policy      ref_logprob  log q(x_t)     reference
    kl_exact     KL(p || q), full vocab   (pi_ref)    entropy      H(p)
    k1, k2, k3   sampled estimators of KL(p || q) from log p(x_t) - log q(x_t) (rl.objectives.kl.kl_estimate)

p is the policy, q the reference: every KL here is KL(policy || reference), the direction rl.objectives.kl calls
`pi_ref` (the RL-for-LLM literature's "reverse KL").

R.json: {"policy", "ref", "tp", "dp", "sequences": [{"line", "response_start", "n_tokens", "logprob": [..],
"ref_logprob", "kl_exact", "k1", "k2", "k3", "entropy", "sum": {"kl_exact", "k1", "k2", "k3"}}, ...],
"summary": {"n_sequences", "n_tokens", "kl_exact_mean", "k1_mean", "k2_mean", "k3_mean", "entropy_mean"}}
(means over all response tokens). Written atomically by rank 0. Bad input (line number named),
mismatched tokenizers or vocabularies: one error on every rank, exit status 2, no R.json.
Models are not FSDP-sharded here (each rank holds its TP shard), so dp ranks need not step together.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from core.ckpt import (
    CheckpointError,
    load_model_weights,
    raise_on_all_ranks,
    read_manifest,
    resolve_checkpoint,
    world_group,
    write_bytes_atomic,
)
from core.ckpt.adapters import adapt_to_checkpoint
from core.config import ModelConfig, from_dict
from core.model import Transformer
from core.runtime.lifecycle import exit_process, shutdown
from parallel.dims import LayoutError, ParallelDims, init_parallel, kv_replica_group, launch_world_size, resolve_device
from parallel.fused import fused_head
from rl.objectives.kl import HEAD_DIRECTION, kl_estimate

FIELDS = ("logprob", "ref_logprob", "kl_exact", "k1", "k2", "k3", "entropy")


class KLEvalError(CheckpointError):
    """Input that kl_eval cannot use; the message names the file and line."""


def read_sequences(path: str, vocab_size: int, max_seq_len: int) -> list[tuple[int, list[int], int]]:
    """(line number, tokens, response_start) for every non-blank line; raises KLEvalError naming the line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise KLEvalError(f"{path}: cannot read ({e})") from e
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise KLEvalError(f"{where}: malformed JSON ({e})") from e
        if not isinstance(rec, dict):
            raise KLEvalError(f"{where}: expected a JSON object with 'tokens' and 'response_start'")
        for key in ("tokens", "response_start"):
            if key not in rec:
                raise KLEvalError(f"{where}: missing key '{key}'")
        toks, k = rec["tokens"], rec["response_start"]
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise KLEvalError(f"{where}: 'tokens' must be a list of integers")
        if len(toks) > max_seq_len:
            raise KLEvalError(f"{where}: sequence of {len(toks)} tokens exceeds the model's max_seq_len={max_seq_len}")
        bad = next((i for i, t in enumerate(toks) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise KLEvalError(f"{where}: token id {toks[bad]} at position {bad} is outside the vocabulary "
                              f"[0, {vocab_size})")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k < len(toks):
            raise KLEvalError(f"{where}: response_start={k!r} out of range: need 1 <= response_start < "
                              f"len(tokens)={len(toks)}")
        out.append((n, toks, k))
    if not out:
        raise KLEvalError(f"{path}: no sequences")
    return out


def _prepare(policy: str, ref: str, tokens: str):
    """Both manifests' configs (checked to agree on the vocabulary and tokenizer) and the sequences."""
    pm, rm = read_manifest(resolve_checkpoint(policy)), read_manifest(resolve_checkpoint(ref))
    pf, rf = pm["tokenizer_fingerprint"], rm["tokenizer_fingerprint"]
    if pf != rf:
        raise KLEvalError(f"tokenizer mismatch (policy/reference): policy {policy} has {pf}, reference {ref} has {rf}")
    pcfg, rcfg = from_dict(ModelConfig, pm["model_config"]), from_dict(ModelConfig, rm["model_config"])
    if pcfg.vocab_size != rcfg.vocab_size:
        raise KLEvalError(f"vocab_size differs: policy {pcfg.vocab_size}, reference {rcfg.vocab_size}")
    return pcfg, rcfg, read_sequences(tokens, pcfg.vocab_size, min(pcfg.max_seq_len, rcfg.max_seq_len))


def _load(cfg: ModelConfig, path: str, state, what: str, verify: bool = True) -> Transformer:
    model = Transformer(cfg, state.tp_group, kv_replica_group(state, cfg.n_kv_heads), device="meta")
    model = adapt_to_checkpoint(model.to_empty(device=state.device), path)  # a LoRA run's model: base + adapters
    load_model_weights(model, path, state, what=what, verify=verify)  # hashes the files first
    return model.eval()


@torch.no_grad()
def score(policy: Transformer, ref: Transformer, toks: list[int], k: int, state) -> dict:
    """Per response token statistics of one sequence (lists of floats, replicated over tp)."""
    ids = torch.tensor([toks], device=state.device)
    L, V = len(toks), policy.cfg.vocab_size
    ref_h, ref_w = ref(ids, head=lambda h, w: (h, w))  # final hidden [1, L, H] and local head [Vp/tp, H]
    targets = ids[0, k:]

    def head(h, w):
        return fused_head(h[0, k - 1:L - 1], w, targets, state.tp_group, vocab_size=V,
                          ref_hidden=ref_h[0, k - 1:L - 1], ref_weight_local=ref_w, entropy=True,
                          kl=HEAD_DIRECTION["pi_ref"])

    out = policy(ids, head=head)
    logp, ref_logp = out.logprobs.double(), out.ref_logprobs.double()
    vals = {"logprob": logp, "ref_logprob": ref_logp, "kl_exact": out.kl, "entropy": out.entropy,
            **{e: kl_estimate(logp, ref_logp, e) for e in ("k1", "k2", "k3")}}
    return {name: [float(x) for x in vals[name].cpu()] for name in FIELDS}


def summarise(seqs: list[dict]) -> dict:
    n = sum(s["n_tokens"] for s in seqs)
    out = {"n_sequences": len(seqs), "n_tokens": n}
    for f in ("kl_exact", "k1", "k2", "k3", "entropy"):
        out[f"{f}_mean"] = sum(sum(s[f]) for s in seqs) / n
    return out


def evaluate(policy: str, ref: str, tokens: str, tp: int, out: str, device: str | None = None,
             verify: bool = True) -> dict | None:
    """Run the evaluation on this rank (every rank calls it); rank 0 writes `out` and returns the
    summary, other ranks return None. `verify`: hash both checkpoints' model files before loading."""
    world = launch_world_size()
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):  # before any work, on every rank: not after the whole evaluation
        raise ValueError(f"--out={out}: directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--out={out}: directory {out_dir} is not writable")
    if tp < 1 or world % tp:
        raise LayoutError(f"--tp={tp} must divide the number of processes ({world})")
    state = init_parallel(ParallelDims(world // tp, tp), resolve_device(device or "auto"))
    pcfg, rcfg, seqs = raise_on_all_ranks(lambda: _prepare(policy, ref, tokens), world_group(state))
    pmodel, rmodel = _load(pcfg, policy, state, "policy", verify), _load(rcfg, ref, state, "reference", verify)
    mine = []
    for idx in range(state.dp_rank, len(seqs), state.dims.dp):  # sequences split over dp
        line, toks, k = seqs[idx]
        vals = score(pmodel, rmodel, toks, k, state)
        mine.append({"index": idx, "line": line, "response_start": k, "n_tokens": len(toks) - k, **vals,
                     "sum": {f: sum(vals[f]) for f in ("kl_exact", "k1", "k2", "k3")}})
    if world > 1:
        every = [None] * world if state.rank == 0 else None
        # control plane: every dp rank's results (TP rank 0 of each group) to rank 0 for the file
        dist.gather_object(mine if state.tp_rank == 0 else [], every, dst=0)
        results = [r for part in every for r in part] if state.rank == 0 else None
    else:
        results = mine

    def write() -> dict:
        rows = sorted(results, key=lambda r: r["index"])
        for r in rows:
            del r["index"]
        summary = summarise(rows)
        doc = {"policy": policy, "ref": ref, "tp": tp, "dp": state.dims.dp, "sequences": rows, "summary": summary}
        write_bytes_atomic(out, json.dumps(doc, allow_nan=False).encode("utf-8"))
        return summary

    summary = raise_on_all_ranks(write, world_group(state), src=0)  # every rank returns once R.json is there
    return summary if state.rank == 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.kl_eval", description=__doc__.split("\n")[0])
    ap.add_argument("--policy", required=True, help="policy checkpoint (kltron model or train checkpoint)")
    ap.add_argument("--ref", required=True, help="reference checkpoint")
    ap.add_argument("--tokens", required=True, help='JSONL: {"tokens": [...], "response_start": k} per line')
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", required=True, help="R.json")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")
    args = ap.parse_args(argv)
    owns = not dist.is_initialized()
    ok = False
    try:
        summary = evaluate(args.policy, args.ref, args.tokens, args.tp, args.out, args.device, not args.no_verify)
        ok = True
    except (CheckpointError, LayoutError, ValueError) as e:
        print(f"kltron.kl_eval: error (rank {os.environ.get('RANK', '0')}): {e}", file=sys.stderr)
        return 2
    finally:
        if owns:
            shutdown(barrier=ok)  # on success every rank meets before any tears down
    if summary is not None:
        print(f"kltron.kl_eval: {summary['n_sequences']} sequences, {summary['n_tokens']} tokens, "
              f"mean KL {summary['kl_exact_mean']:.6f} (k1 {summary['k1_mean']:.6f}, k3 {summary['k3_mean']:.6f}) "
              f"-> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    exit_process(main())
