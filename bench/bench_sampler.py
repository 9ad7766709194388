"""The layout-invariant sampler against torch.multinomial(softmax), and generation before vs after.

    python -m bench.bench_sampler [--threads 1] [--repeats 5] [--old-ref main] [--skip-gen] [--json OUT]
    python -m bench.bench_sampler --device cuda --skip-gen    # the sampler part on a GPU (synchronised timing)
    python -m bench.bench_sampler --skip-gen --rows 64 --vocab 4096    # a smaller logits shape (a quick check)

1. Sampler at [256, 32000] fp32 logits (`--rows`, `--vocab`): kltron's sampler (eager, and torch.compile'd with its
   one-time compile cost), top-p / min-p variants, and `--old-ref`'s core/generation/sampling.py (eager and
   compiled), each beside `torch.multinomial(torch.softmax(logits, -1), 1)` in the same
   run; ratio = sampler / multinomial (lower is faster). Repeats interleave the two; medians.
2. Generation (prefill + decode) of the tiny model and a ~60M model (hidden 512, 8 layers,
   vocab 32000), 32 prompts x 8 samples, with `--old-ref`'s generate (imported from git) and the
   new one; and the new one with vs without batch compaction when rows stop at different lengths
   (every 8th id is an EOS: geometric response lengths), checking both give the same tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from core.config import ModelConfig
from core.generation.generate import generate
from core.generation.sampling import sample_from_sharded_logits

MODELS = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=176,
                        max_seq_len=64),
    "60M": ModelConfig(vocab_size=32000, hidden_size=512, n_layers=8, n_heads=8, n_kv_heads=4,
                       intermediate_size=1408, max_seq_len=128),
}


def load_old(ref: str, path: str = "core/generation/generate.py", name: str = "old_generate"):
    """`path` as of git `ref`, imported as a separate module `name` (None when unavailable or ref is "none")."""
    if ref in ("", "none"):
        return None
    try:
        src = subprocess.run(["git", "show", f"{ref}:{path}"], capture_output=True, text=True, check=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"[old] cannot read {ref}:{path} ({e}); skipping the before numbers")
        return None
    tmp = tempfile.NamedTemporaryFile("w", suffix=f"_{name}.py", delete=False)
    tmp.write(src)
    tmp.close()
    spec = importlib.util.spec_from_file_location(name, tmp.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


def load_old_generate(ref: str):
    """core/generation/generate.py as of git `ref` (its sampler is whatever core/generation/sampling.py this
    tree has)."""
    return load_old(ref)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str = "cpu") -> float:
    """Seconds of fn(); on CUDA between synchronisations, so queued kernels are counted."""
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def side_by_side(fn, ref, repeats: int, device: str = "cpu") -> tuple[float, float]:
    """Medians (s) of fn and ref, interleaved after one warm-up each."""
    fn(), ref()
    a, b = [], []
    for _ in range(repeats):
        a.append(timed(fn, device))
        b.append(timed(ref, device))
    return statistics.median(a), statistics.median(b)


def bench_sampler(repeats: int, old_ref: str, out: dict, device: str = "cpu", rows: int = 256,
                  vocab: int = 32000) -> None:
    B, V = rows, vocab
    torch.manual_seed(0)
    logits = (torch.randn(B, V) * 2).to(device)
    rows = torch.arange(B, device=device)
    kw = dict(vocab_size=V, temperature=1.0, seed=1, step=0, row_ids=rows, position=0)
    gen = torch.Generator(device=device).manual_seed(0)

    def multinomial():
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)

    compile_s = timed(lambda: sample_from_sharded_logits(logits, compile=True, **kw), device)
    cases = {
        "eager": lambda: sample_from_sharded_logits(logits, **kw),
        "compiled": lambda: sample_from_sharded_logits(logits, compile=True, **kw),
        "eager top_k=50": lambda: sample_from_sharded_logits(logits, top_k=50, **kw),
        "eager top_p=0.9": lambda: sample_from_sharded_logits(logits, top_p=0.9, **kw),
        "eager min_p=0.05": lambda: sample_from_sharded_logits(logits, min_p=0.05, **kw),
    }
    def hf_top_p():  # transformers' TopPLogitsWarper then multinomial: a full sort per row
        srt, order = logits.sort(dim=-1)
        drop = srt.softmax(-1).cumsum(-1) <= 1 - 0.9
        masked = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        return torch.multinomial(torch.softmax(masked, -1), 1, generator=gen)

    t_hf, t_ours = side_by_side(hf_top_p, lambda: sample_from_sharded_logits(logits, top_p=0.9, **kw), repeats,
                                device)
    old = load_old(old_ref, "core/generation/sampling.py", "old_sampling")
    if old is not None:
        cases[f"eager, {old_ref}'s sampler"] = lambda: old.sample_from_sharded_logits(logits, **kw)
        cases[f"compiled, {old_ref}'s"] = lambda: old.sample_from_sharded_logits(logits, compile=True, **kw)
    print(f"\n== sampler at [{B}, {V}] fp32 on {device}, threads={torch.get_num_threads()}; compile (one-time) "
          f"{compile_s:.1f} s")
    print(f"{'case':22s} {'sampler ms':>11s} {'multinomial ms':>15s} {'ratio':>7s}")
    out["sampler"] = {"compile_s": compile_s, "device": device, "shape": [B, V]}
    for name, fn in cases.items():
        s, m = side_by_side(fn, multinomial, repeats, device)
        out["sampler"][name] = dict(sampler_ms=s * 1e3, multinomial_ms=m * 1e3, ratio=s / m)
        print(f"{name:22s} {s * 1e3:11.1f} {m * 1e3:15.1f} {s / m:7.2f}")
    out["sampler"]["top_p vs sort-based"] = dict(sampler_ms=t_ours * 1e3, sort_top_p_ms=t_hf * 1e3,
                                                 ratio=t_ours / t_hf)
    print(f"top_p=0.9 {t_ours * 1e3:.1f} ms vs sort-based top-p + multinomial {t_hf * 1e3:.1f} ms: "
          f"ratio {t_ours / t_hf:.2f}")


def _prompts(cfg: ModelConfig, n_prompts=32, group=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(6, 17, (n_prompts,), generator=g).repeat_interleave(group)
    P = int(lens.max())
    ids = torch.randint(3, cfg.vocab_size, (len(lens), P), generator=g)
    mask = (torch.arange(P)[None, :] >= P - lens[:, None]).long()  # left padding
    return ids.masked_fill(mask == 0, 0), mask


def bench_generation(repeats: int, old, out: dict) -> None:
    from core.model import build_model
    print(f"\n== generation: 32 prompts x 8 samples, prompts 6-16 tokens, threads={torch.get_num_threads()}")
    for name, cfg in MODELS.items():
        out[f"gen_{name}"] = bench_model(name, build_model(cfg, seed=0).eval(), repeats, old)


def bench_model(name: str, model, repeats: int, old) -> dict:
    cfg = model.cfg
    ids, mask = _prompts(cfg)
    new_tokens = 6 if name == "60M" else 12
    kw = dict(max_new_tokens=new_tokens, pad_id=0, temperature=1.0, top_k=0, seed=3)
    res = {}
    if old is not None:
        o, n = side_by_side(lambda: old.generate(model, ids, mask, eos_id=2, **kw),
                            lambda: generate(model, ids, mask, eos_id=2, **kw), repeats)
        res.update(old_s=o, new_s=n, ratio=n / o)
        print(f"{name:5s} N={new_tokens}: old {o:.3f} s  new {n:.3f} s  new/old {n / o:.2f}")
    # skewed stops: every 8th id ends a row (geometric lengths, mean ~8)
    eos = list(range(2, cfg.vocab_size, 8))
    skew = dict(kw, max_new_tokens=24)
    a = generate(model, ids, mask, eos_id=None, eos_ids=eos, compact=True, **skew)
    b = generate(model, ids, mask, eos_id=None, eos_ids=eos, compact=False, **skew)
    same = torch.equal(a.sequences, b.sequences)
    c, nc = side_by_side(lambda: generate(model, ids, mask, eos_id=None, eos_ids=eos, compact=True, **skew),
                         lambda: generate(model, ids, mask, eos_id=None, eos_ids=eos, compact=False, **skew),
                         repeats)
    lens = a.response_mask.sum(1).float()
    res.update(compact_s=c, no_compact_s=nc, compact_ratio=c / nc, same_tokens=same,
               tokens_per_s=a.n_tokens / c, mean_len=float(lens.mean()), max_len=int(lens.max()))
    print(f"{name:5s} skewed stops (mean {lens.mean():.1f}, max {int(lens.max())} of {skew['max_new_tokens']}): "
          f"compact {c:.3f} s  no compaction {nc:.3f} s  ratio {c / nc:.2f}  same tokens {same}  "
          f"{a.n_tokens / c:.0f} tokens/s")
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="sampler repeats")
    ap.add_argument("--gen-repeats", type=int, default=2, help="generation repeats")
    ap.add_argument("--old-ref", default="main",
                    help="git ref whose core/generation/generate.py is the 'before' ('none': skip)")
    ap.add_argument("--skip-gen", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the sampler part runs")
    ap.add_argument("--rows", type=int, default=256, help="rows of the sampler's logits")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary of the sampler's logits")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    old = load_old_generate(args.old_ref)
    out = {"threads": args.threads, "torch": torch.__version__}
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    bench_sampler(args.repeats, args.old_ref, out, args.device, args.rows, args.vocab)
    if not args.skip_gen:
        bench_generation(args.gen_repeats, old, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
