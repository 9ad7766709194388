"""The KL paths the tool compares, as functions of one rank's inputs; each returns the per-token
outputs (log p(target) [T], entropy [T] or None, KL or its estimate [T]) and the scalar loss to
backpropagate.

| name             | method     | mode  | what it does (per TP rank; heads sharded [Vp/tp, H])                 |
|---|---|---|---|
| matmul_floor     | matmul     | -     | the head's matmuls alone, chunked: logits p and q (+ dz @ W, dz^T @ h)|
| gather           | gather     | exact | local logits, all-gather to [T, V], torch log_softmax, exact KL       |
| vp_materialized  | vp         | exact | local logits [T, Vp/tp] kept; parallel/vocab.py functions, no chunking|
| vp_chunked       | vp_chunked | exact | the same with chunk_size tokens at a time                             |
| fused_exact      | fused      | exact | parallel/fused.py: no logits tensor, chunked, recomputed in backward  |
| fused_exact_loss | fused_loss | exact | parallel/fused_loss.py: the loss inside, gradient formed in forward   |
| fused_k3         | fused      | k3    | fused head for log p and log q of the sampled tokens, then k3         |
| fused_k3_loss    | fused_loss | k3    | log q(t) by a no-grad fused head on the reference, then fused_head_loss |
|                  |            |       | with k3(log p, log q) in its token_loss: like with like for fused_exact_loss |

Distillation (tools/klcost/distill_methods.py, the reference's side read as a teacher whose hidden width
`ref_hidden` may differ from the student's): distill_fused_loss, distill_jsd, distill_topk, distill_jsd_call,
and gather / fused_exact themselves at two widths. Peers (tools/klcost/peers.py) add verl_k3, trl_k3, cce_k3
and liger_jsd.

The forward+backward loss is a fixed linear function of the outputs (coefficients `coef` [3, T]),
so every method backpropagates the same thing.
"""

from __future__ import annotations

import torch

from core.config import ModelConfig
from parallel import comm
from parallel.fused import fused_head
from parallel.fused_loss import fused_head_loss
from parallel.vocab import vocab_parallel_entropy, vocab_parallel_kl, vocab_parallel_logprobs
from tools.klcost.distill_methods import distill_outputs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
METHODS = {  # name -> (method, mode)
    "matmul_floor": ("matmul", "-"),
    "gather": ("gather", "exact"),
    "vp_materialized": ("vp", "exact"),
    "vp_chunked": ("vp_chunked", "exact"),
    "fused_exact": ("fused", "exact"),
    "fused_exact_loss": ("fused_loss", "exact"),
    "fused_k3": ("fused", "k3"),
    "fused_k3_loss": ("fused_loss", "k3"),
    "distill_fused_loss": ("fused_loss", "exact"),  # the teacher in the policy head's KL slot (the trainer's path)
    "distill_jsd": ("fused_loss", "jsd"),  # the JSD as the loss head's chunk term (the trainer's path)
    "distill_topk": ("fused_loss", "topk"),  # the teacher's top-k shipped, the cross-entropy as the chunk term
    "distill_jsd_call": ("fused", "jsd"),  # the loss head, then the JSD head as a second call
}
DISTILL = ("distill_fused_loss", "distill_jsd", "distill_topk", "distill_jsd_call")
DEFAULT = ["gather", "vp_materialized", "vp_chunked", "fused_exact", "fused_exact_loss", "fused_k3", "fused_k3_loss"]
CHUNKED = {"matmul_floor", "vp_chunked", "fused_exact", "fused_exact_loss", "fused_k3", "fused_k3_loss", *DISTILL}


class Inputs:
    """One rank's inputs: policy / reference hidden [T, H] (replicated), head shards [Vp/tp, H]
    (rows of this rank's vocabulary slice), targets [T] (global ids), loss coefficients [3, T].
    `ref_hidden`: the reference's (a distillation teacher's) hidden width, H when None."""

    def __init__(self, T, H, V, tp, rank, dtype, seed, grad, device="cpu", fake=False, ref_hidden=None):
        self.V, self.Vp = V, ModelConfig(vocab_size=V).padded_vocab_size(tp)
        width = self.Vp // tp
        Hr = H if ref_hidden is None else ref_hidden
        if fake:  # under a fake mode (projection): shapes only, made on the device itself
            self._empty(T, H, width, dtype, grad, device, Hr)
            return
        g = torch.Generator(device="cpu").manual_seed(seed)
        put = lambda x: x.to(device=device, dtype=dtype)  # drawn on CPU: the same numbers on every device
        self.h = put(torch.randn(T, H, generator=g, device="cpu")).requires_grad_(grad)
        self.hr = put(torch.randn(T, Hr, generator=g, device="cpu"))
        g_w = torch.Generator(device="cpu").manual_seed(seed + 1 + rank)  # each rank's own rows of the heads
        w = torch.randn(width, H, generator=g_w, device="cpu") * H**-0.5 * 2
        if Hr == H:
            self.wr = put(w + torch.randn(width, H, generator=g_w, device="cpu") * H**-0.5 * 0.3)
        else:  # a teacher of another width: its own head
            self.wr = put(torch.randn(width, Hr, generator=g_w, device="cpu") * Hr**-0.5 * 2)
        self.w = put(w).requires_grad_(grad)
        self.t = torch.randint(0, V, (T,), generator=g, device="cpu").to(device)
        self.coef = torch.randn(3, T, generator=g, device="cpu").to(device)

    def _empty(self, T, H, width, dtype, grad, device, Hr):
        self.h = torch.empty(T, H, dtype=dtype, device=device).requires_grad_(grad)
        self.hr = torch.empty(T, Hr, dtype=dtype, device=device)
        self.w = torch.empty(width, H, dtype=dtype, device=device).requires_grad_(grad)
        self.wr = torch.empty(width, Hr, dtype=dtype, device=device)
        self.t = torch.zeros(T, dtype=torch.long, device=device)
        self.coef = torch.empty(3, T, device=device)

    def tensors(self):
        return self.h, self.w, self.hr, self.wr, self.t, self.coef


def linear_loss(outs, coef):
    return sum((o.float() * c).sum() for o, c in zip(outs, coef) if o is not None)


def k3(logp, logq):
    """k3 = r - 1 - log r with r = q(t) / p(t), per sampled token."""
    log_ratio = logq - logp
    return torch.expm1(log_ratio) - log_ratio


def matmul_floor(x: Inputs, hp, chunk, backward):
    """The head's matmuls and nothing else, chunk by chunk: z = h_c W^T and z_q = h_r,c W_r^T, and in
    a backward pass dh_c = dz W and dW += dz^T h_c with dz = z (the floor any exact or sampled head
    pays; no softmax, no collective). Returns (outputs, None): nothing to backpropagate."""
    with torch.no_grad():
        h, w = hp.detach(), x.w.detach()
        gw = torch.zeros_like(w) if backward else None
        gh = torch.empty_like(h) if backward else None
        for s in range(0, h.shape[0], chunk):
            z = h[s:s + chunk] @ w.T
            zq = x.hr[s:s + chunk] @ x.wr.T
            if backward:
                torch.matmul(z, w, out=gh[s:s + chunk])
                gw.addmm_(z.T, h[s:s + chunk])
            del z, zq
    return (None, None, None), None


def outputs(name, x: Inputs, group, chunk, backward):
    """((log p(t), entropy or None, KL-ish term), loss) for one built-in method; loss is None when
    there is nothing to backpropagate."""
    hp = comm.copy_to_tp(x.h, group)  # replicated hidden: backward sums the ranks' partial grads
    if name == "matmul_floor":
        return matmul_floor(x, hp, chunk, backward)
    if name == "fused_exact_loss":  # the same linear loss, per chunk of tokens `s`
        c = x.coef
        token_loss = lambda lp, ent, kl, s: lp.float() * c[0][s] + ent.float() * c[1][s] + kl.float() * c[2][s]
        loss, out = fused_head_loss(hp, x.w, x.t, group, vocab_size=x.V, ref_hidden=x.hr, ref_weight_local=x.wr,
                                    chunk_size=chunk, entropy=True, kl="forward", token_loss=token_loss)
        return (out.logprobs, out.entropy, out.kl), loss
    if name == "fused_k3_loss":
        return _fused_k3_loss(x, hp, group, chunk)
    if name in DISTILL:
        return distill_outputs(name, x, hp, group, chunk)
    outs = _plain_outputs(name, x, hp, group, chunk)
    return outs, linear_loss(outs, x.coef)


def _fused_k3_loss(x: Inputs, hp, group, chunk):
    """log q(t) first (no grad, as a trainer's experience phase computes it), then the policy's fused
    head with the loss inside: token_loss(log p) = c0 log p + c2 k3(log p, log q)."""
    with torch.no_grad():
        logq = fused_head(x.hr, x.wr, x.t, group, vocab_size=x.V, chunk_size=chunk, entropy=False).logprobs
    c = x.coef
    token_loss = lambda lp, ent, kl, s: lp.float() * c[0][s] + k3(lp.float(), logq[s].float()) * c[2][s]
    loss, out = fused_head_loss(hp, x.w, x.t, group, vocab_size=x.V, chunk_size=chunk, entropy=False, kl=None,
                                token_loss=token_loss)
    return (out.logprobs, None, k3(out.logprobs.float(), logq.float())), loss


def _plain_outputs(name, x: Inputs, hp, group, chunk):
    V, t = x.V, x.t
    if name == "gather":
        zp = comm.gather_from_tp(hp @ x.w.T, group)[:, :V].float()  # [T, Vp] gathered, padding dropped
        zq = comm.gather_from_tp(x.hr @ x.wr.T, group)[:, :V].float()
        logp, logq = torch.log_softmax(zp, -1), torch.log_softmax(zq, -1)
        p = logp.exp()
        return (logp.gather(1, t[:, None])[:, 0], -(p * logp).sum(-1), (p * (logp - logq)).sum(-1))
    if name in ("vp_materialized", "vp_chunked"):
        c = chunk if name == "vp_chunked" else None
        zp, zq = hp @ x.w.T, x.hr @ x.wr.T  # [T, Vp/tp] each, sharded on the vocabulary
        kw = dict(vocab_size=V, chunk_size=c)
        return (vocab_parallel_logprobs(zp, t, group, **kw), vocab_parallel_entropy(zp, group, **kw),
                vocab_parallel_kl(zp, zq, group, **kw))
    if name == "fused_exact":
        out = fused_head(hp, x.w, t, group, vocab_size=V, ref_hidden=x.hr, ref_weight_local=x.wr, chunk_size=chunk,
                         entropy=True, kl="forward")
        return out.logprobs, out.entropy, out.kl
    if name == "fused_k3":
        out = fused_head(hp, x.w, t, group, vocab_size=V, ref_hidden=x.hr, ref_weight_local=x.wr, chunk_size=chunk,
                         entropy=False, kl=None)
        return out.logprobs, None, k3(out.logprobs, out.ref_logprobs)
    raise ValueError(f"unknown method {name!r}; choose from {list(METHODS)}")
