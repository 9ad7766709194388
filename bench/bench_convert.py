"""Peak memory of tools/convert_hf on a synthetic Llama checkpoint: streaming means the peak RSS
grows by about the largest tensor (twice when casting), not by the checkpoint size.

    python -m bench.bench_convert [--layers 4 --hidden 1024 --inter 2816 --vocab 16000] [--dir D]

Writes a random HF-layout checkpoint (fp32, untied, ~340 MB by default) tensor by tensor, then, each
in a fresh subprocess: import (--dtype keep), import (--dtype bf16), export. Each child reports
ru_maxrss after its imports and after the conversion; the delta is the conversion's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import resource, time, json
import torch
from tools.convert_hf import import_hf, export_hf
torch.set_num_threads(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
{call}
dt = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"rss_before": before, "rss_peak": after, "seconds": dt}}))
"""


def write_synthetic(path: str, layers: int, hidden: int, inter: int, vocab: int, heads: int = 16, kv: int = 4):
    import torch

    from core.ckpt import StreamingWriter

    hd = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (heads * hd, hidden),
                       p + "self_attn.k_proj.weight": (kv * hd, hidden),
                       p + "self_attn.v_proj.weight": (kv * hd, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * hd), p + "mlp.gate_proj.weight": (inter, hidden),
                       p + "mlp.up_proj.weight": (inter, hidden), p + "mlp.down_proj.weight": (hidden, inter)})
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    with StreamingWriter(path, "model", {n: (torch.float32, s) for n, s in shapes.items()}) as w:
        for n in w.order:
            w.write(n, torch.randn(shapes[n], generator=g))
        w.close()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "float32", "tie_word_embeddings": False}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    sizes = [4 * int(torch.tensor(s).prod()) for s in shapes.values()]
    return sum(sizes), max(sizes)


def run_child(call: str) -> dict:
    # the child imports tools.convert_hf from this checkout
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHILD.format(call=call)], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="bench_convert_")
    hf, ck, ck16, out = (os.path.join(base, n) for n in ("hf", "ckpt", "ckpt_bf16", "export"))
    t0 = time.perf_counter()
    total, largest = write_synthetic(hf, args.layers, args.hidden, args.inter, args.vocab)
    print(f"synthetic checkpoint: {total / 2**20:.1f} MiB, largest tensor {largest / 2**20:.1f} MiB "
          f"(written in {time.perf_counter() - t0:.1f}s)")
    runs = {"import keep": f"import_hf({hf!r}, {ck!r})", "import bf16": f"import_hf({hf!r}, {ck16!r}, 'bf16')",
            "export": f"export_hf({ck!r}, {out!r})"}
    for name, call in runs.items():
        r = run_child(call)
        delta = r["rss_peak"] - r["rss_before"]
        print(f"{name:12s}: peak RSS +{delta / 2**20:7.1f} MiB over {r['rss_before'] / 2**20:.0f} MiB after imports "
              f"= {delta / total:.2f}x checkpoint, {delta / largest:.2f}x largest tensor; {r['seconds']:.1f}s")
    if args.dir is None:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
