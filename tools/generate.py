"""Generate from a kltron checkpoint, or chat with it, from the command line.

    python -m tools.generate --ckpt C --prompt "What is 12 + 30?" [--prompt ...] [--chat [--system S]]
        [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--json]
    torchrun --nproc_per_node N -m tools.generate --ckpt C --tp N --prompt ...

`C` is a converted checkpoint (`tools.convert_hf import`), a run's `{out_dir}/model`, or a training
checkpoint root (its latest complete step). The tokenizer is `--tokenizer`, else the checkpoint's own
files (converted checkpoints carry them), else the shipped one; its fingerprint must match the
checkpoint's. `--chat` renders each prompt as a user turn (after `--system`, when given) with the
checkpoint's chat template and the generation prompt, as `apply_chat_template(...,
add_generation_prompt=True)`; without it the text is encoded as is (bos first when the tokenizer adds
one). Sampling is core.generation.generate's, under tensor parallelism without gathering logits: temperature 0
(the default) is greedy; a row stops on any of the tokenizer's EOS ids or after --max-new-tokens; ids
past the tokenizer's vocabulary (a padded embedding) are never drawn. The same --seed gives the same
tokens for every --tp. Rank 0 prints each response (without its stop token), or with --json one line
per prompt: {"prompt", "prompt_ids", "response_ids" (with the stop token), "text", "stop": "eos" |
"length"}.
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
)
from core.ckpt.adapters import adapt_to_checkpoint
from core.config import ModelConfig, from_dict
from core.generation.generate import generate
from core.model import Transformer
from core.runtime.lifecycle import exit_process, shutdown
from core.tokenizer import TokenizerError, load_tokenizer
from parallel.dims import LayoutError, ParallelDims, init_parallel, kv_replica_group, launch_world_size, resolve_device


def prompt_ids(tokenizer, text: str, chat: bool, system: str | None) -> list[int]:
    """The ids generation starts from: the chat template's rendering of one user turn, or the plain text."""
    if not chat:
        return tokenizer.encode(text, bos=tokenizer.adds_bos)
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": text}]
    return tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True))


def _prepare(ckpt: str, tokenizer_path: str | None):
    """(checkpoint folder, its ModelConfig, the tokenizer); every error names the file."""
    folder = resolve_checkpoint(ckpt)
    cfg = from_dict(ModelConfig, read_manifest(folder)["model_config"])
    if tokenizer_path is None:
        own = any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer.model"))
        tokenizer_path = folder if own else None
    return folder, cfg, load_tokenizer(tokenizer_path)


@torch.no_grad()
def run(args) -> list[dict] | None:
    """Load on every rank, generate each prompt in turn; rank 0 returns the results, others None."""
    world = launch_world_size()
    tp = args.tp or world
    if tp != world:
        raise LayoutError(f"--tp={tp} must equal the number of processes ({world}): one prompt runs on all ranks")
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ValueError(f"need --max-new-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0; got "
                         f"{args.max_new_tokens}, {args.temperature}, {args.top_p}, {args.top_k}")
    device = resolve_device(args.device)
    state = init_parallel(ParallelDims(1, tp), device)
    folder, cfg, tok = raise_on_all_ranks(lambda: _prepare(args.ckpt, args.tokenizer), world_group(state))
    if args.chat and tok.chat_template is None:
        raise TokenizerError(f"--chat: the tokenizer {tok.path} has no chat_template (drop --chat for plain text)")
    model = Transformer(cfg, state.tp_group, kv_replica_group(state, cfg.n_kv_heads), device="meta")
    model = adapt_to_checkpoint(model.to_empty(device=device), folder)  # a LoRA run's model: base + adapters
    load_model_weights(model, folder, state, tokenizer_fingerprint=tok.fingerprint, verify=not args.no_verify)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    model.eval().set_mixed_precision(dtype)
    vocab = min(cfg.vocab_size, tok.vocab_size)
    pad = tok.pad_id if tok.pad_id is not None else (tok.eos_id if tok.eos_id is not None else 0)
    out = []
    for i, text in enumerate(args.prompt):
        ids = prompt_ids(tok, text, args.chat, args.system)
        gen = generate(model, torch.tensor([ids], device=device), torch.ones(1, len(ids), dtype=torch.long,
                                                                              device=device),
                       max_new_tokens=args.max_new_tokens, eos_id=tok.eos_id, eos_ids=tok.eos_ids, pad_id=pad,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       row_ids=torch.tensor([i], device=device), tp_group=state.tp_group, vocab_limit=vocab)
        resp = gen.sequences[0, gen.prompt_len:][gen.response_mask[0].bool()].tolist()
        stopped = bool(resp) and resp[-1] in set(tok.eos_ids)
        out.append({"prompt": text, "prompt_ids": ids, "response_ids": resp,
                    "text": tok.decode(resp[:-1] if stopped else resp), "stop": "eos" if stopped else "length"})
    return out if state.rank == 0 else None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True, help="a kltron checkpoint folder (or a run's checkpoint root)")
    ap.add_argument("--prompt", required=True, action="append", help="the text (repeat for several prompts)")
    ap.add_argument("--chat", action="store_true", help="render each prompt as a user turn with the chat template")
    ap.add_argument("--system", default=None, help="with --chat: a system turn before the user's")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0: off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default and only value: the "
                    "number of processes torchrun starts)")
    ap.add_argument("--tokenizer", default=None, help="default: the checkpoint's own tokenizer files")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="auto: bf16 on CUDA, else fp32")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt instead of the text")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    owns = not dist.is_initialized()
    ok = False
    try:
        results = run(args)
        ok = True
    except (CheckpointError, TokenizerError, LayoutError, ValueError) as e:
        print(f"kltron.generate: error (rank {os.environ.get('RANK', '0')}): {e}", file=sys.stderr)
        return 2
    finally:
        if owns:
            shutdown(barrier=ok)
    for r in results or []:
        print(json.dumps(r, ensure_ascii=False) if args.json else r["text"], flush=True)
    return 0


if __name__ == "__main__":
    exit_process(main())
