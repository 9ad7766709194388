"""A step's rollout on the wire: from the rollout ranks to the trainer ranks, and into a checkpoint.

`StepRollout` is one step's scored rollout (rows prompt-major, as rl/experience/rollout.py makes
them) with the step it is for, the weights version that generated it and the generation's stats.
On the wire (point-to-point over the default group, so gloo and NCCL alike): a fixed-size int64
header (`HEADER` fields), then the payload tensors in a fixed order whose shapes the header gives,
then the pickled per-prompt metas, decoded responses and stats as a uint8 tensor. The rollout
leader sends each trainer rank the rows of its DP rank (`dp_slice`); a rollout DP rank sends its
rows to the leader first, which concatenates them (`concat`).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl.experience.rollout import Rollout

MAGIC = 0x6B6C74  # "klt": a header that is not one (a peer out of step) is refused by name
HEADER = ("magic", "step", "version", "rows", "cols", "response_cols", "prompt_len", "meta_bytes", "has_logprobs",
          "has_sampled_logprobs")


@dataclass
class StepRollout:
    step: int  # the training step these rows are for
    version: int  # the weights version that generated them (the number of updates behind them)
    ro: Rollout
    stats: dict = field(default_factory=dict)  # rollout_s, rollout_tokens, recipe_metrics (global over DP)

    @property
    def versions(self) -> torch.Tensor:
        """[B] the weights version of every row (one per step here; per sample on the wire)."""
        if self.ro.policy_version is not None:
            return self.ro.policy_version
        return torch.full((self.ro.scores.numel(),), self.version, dtype=torch.long, device=self.ro.scores.device)


def _payload(sr: StepRollout) -> list[torch.Tensor]:
    ro = sr.ro
    out = [ro.sequences.long(), ro.attention_mask.long(), ro.response_mask.to(torch.uint8), ro.scores.float(),
           ro.row_ids.long(), sr.versions]
    out += [t.float() for t in (ro.rollout_logprobs, ro.rollout_sampled_logprobs) if t is not None]
    return [t.contiguous() for t in out]


def _meta_bytes(sr: StepRollout) -> bytes:
    return pickle.dumps({"metas": sr.ro.metas, "responses": sr.ro.responses, "stats": sr.stats})


def send(sr: StepRollout, dst: int, device) -> list:
    """Start sending `sr` to global rank `dst` -> [(work, tensor)]: isend, the caller keeps both until the
    work completes."""
    ro = sr.ro
    meta = torch.frombuffer(bytearray(_meta_bytes(sr)), dtype=torch.uint8).to(device)
    B, S = ro.sequences.shape
    head = torch.tensor([MAGIC, sr.step, sr.version, B, S, ro.response_mask.shape[1], ro.prompt_len, meta.numel(),
                         int(ro.rollout_logprobs is not None), int(ro.rollout_sampled_logprobs is not None)],
                        dtype=torch.long, device=device)
    tensors = [t.to(device) for t in (head, *_payload(sr), meta)]
    return [(dist.isend(t, dst), t) for t in tensors]


def recv(src: int, device, expect_step: int | None = None) -> StepRollout:
    """Receive one StepRollout from global rank `src` (blocking)."""
    head = torch.zeros(len(HEADER), dtype=torch.long, device=device)
    dist.recv(head, src)
    h = dict(zip(HEADER, head.tolist()))
    if h["magic"] != MAGIC or (expect_step is not None and h["step"] != expect_step):
        raise RuntimeError(f"rollout channel out of step: expected the rollout of step {expect_step} from rank {src}, "
                           f"got header {h}")
    B, S, N = h["rows"], h["cols"], h["response_cols"]
    shapes = [((B, S), torch.long), ((B, S), torch.long), ((B, N), torch.uint8), ((B,), torch.float32),
              ((B,), torch.long), ((B,), torch.long)]
    shapes += [((B, N), torch.float32)] * (h["has_logprobs"] + h["has_sampled_logprobs"])
    parts = []
    for shape, dt in shapes:
        t = torch.empty(shape, dtype=dt, device=device)
        dist.recv(t, src)
        parts.append(t)
    meta = torch.empty(h["meta_bytes"], dtype=torch.uint8, device=device)
    dist.recv(meta, src)
    m = pickle.loads(meta.cpu().numpy().tobytes())
    seq, att, resp, scores, row_ids, versions = parts[:6]
    rest = iter(parts[6:])
    lp = next(rest) if h["has_logprobs"] else None
    slp = next(rest) if h["has_sampled_logprobs"] else None
    if not bool((versions == h["version"]).all()):
        raise RuntimeError(f"rollout of step {h['step']}: rows of weights versions {versions.unique().tolist()}, "
                           f"the header says {h['version']}")
    ro = Rollout(seq, att, resp.bool(), h["prompt_len"], scores, row_ids, m["metas"], m["responses"], lp, slp,
                 policy_version=versions)
    return StepRollout(h["step"], h["version"], ro, m["stats"])


def concat(parts: list[StepRollout], pad_id: int) -> StepRollout:
    """Rows of several DP ranks' rollouts of one step, in order: prompts left-padded to the longest prompt,
    responses right-padded to the longest response (masks and log-probs 0 there)."""
    if len(parts) == 1:
        return parts[0]
    P = max(p.ro.prompt_len for p in parts)
    N = max(p.ro.response_mask.shape[1] for p in parts)

    def pad(t, pre, post, value):
        return None if t is None else F.pad(t, (pre, post), value=value)
    cols = {k: [] for k in ("seq", "att", "resp", "lp", "slp")}
    for p in parts:
        ro = p.ro
        pre, post = P - ro.prompt_len, N - ro.response_mask.shape[1]
        cols["seq"].append(pad(ro.sequences, pre, post, pad_id))
        cols["att"].append(pad(ro.attention_mask, pre, post, 0))
        cols["resp"].append(pad(ro.response_mask, 0, post, False))
        cols["lp"].append(pad(ro.rollout_logprobs, 0, post, 0.0))
        cols["slp"].append(pad(ro.rollout_sampled_logprobs, 0, post, 0.0))
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    ro = Rollout(cat(cols["seq"]), cat(cols["att"]), cat(cols["resp"]), P, torch.cat([p.ro.scores for p in parts]),
                 torch.cat([p.ro.row_ids for p in parts]), [m for p in parts for m in p.ro.metas],
                 [s for p in parts for s in p.ro.responses], cat(cols["lp"]), cat(cols["slp"]))
    stats = dict(parts[0].stats)
    stats["rollout_s"] = max(p.stats.get("rollout_s", 0.0) for p in parts)  # the DP ranks generate side by side
    stats["rollout_tokens"] = sum(p.stats.get("rollout_tokens", 0) for p in parts)
    return StepRollout(parts[0].step, parts[0].version, ro, stats)


def dp_slice(sr: StepRollout, dp_rank: int, dp_size: int, group_size: int) -> StepRollout:
    """The rows of trainer DP rank `dp_rank` of `dp_size` (its contiguous share of the step's prompts), with the
    prompt columns every one of its rows pads cut off (its layout as a colocated rollout of those rows has it)."""
    n_prompts = len(sr.ro.metas)
    if n_prompts % dp_size:
        raise ValueError(f"the rollout of step {sr.step} has {n_prompts} prompts, not a multiple of dp={dp_size}")
    per = n_prompts // dp_size
    rows = torch.arange(dp_rank * per * group_size, (dp_rank + 1) * per * group_size, device=sr.ro.scores.device)
    ro = sr.ro.select(rows) if dp_size > 1 else sr.ro
    if dp_size > 1:
        ro.metas = sr.ro.metas[dp_rank * per:(dp_rank + 1) * per]
        prompt_real = ro.attention_mask[:, :ro.prompt_len].bool().any(0)
        cut = int(prompt_real.long().argmax()) if bool(prompt_real.any()) else 0
        if cut:
            ro.sequences, ro.attention_mask = ro.sequences[:, cut:], ro.attention_mask[:, cut:]
            ro.prompt_len -= cut
    stats = dict(sr.stats, rollout_tokens=int(ro.response_mask.sum()))
    return StepRollout(sr.step, sr.version, ro, stats)


def to_bytes(srs: list[StepRollout]) -> bytes:
    """In-flight rollouts for a checkpoint: CPU tensors and metas, torch.save'd (weights_only-loadable)."""
    items = []
    for sr in srs:
        ro = sr.ro
        items.append({"step": sr.step, "version": sr.version, "prompt_len": ro.prompt_len,
                      "tensors": [None if t is None else t.cpu() for t in _payload_fields(ro)],
                      "meta": _meta_bytes(sr)})
    buf = io.BytesIO()
    torch.save(items, buf)
    return buf.getvalue()


def _payload_fields(ro: Rollout) -> list:
    return [ro.sequences, ro.attention_mask, ro.response_mask, ro.scores, ro.row_ids, ro.rollout_logprobs,
            ro.rollout_sampled_logprobs]


def from_bytes(data: bytes, device) -> list[StepRollout]:
    out = []
    for it in torch.load(io.BytesIO(data), weights_only=True):
        m = pickle.loads(it["meta"])
        t = [None if x is None else x.to(device) for x in it["tensors"]]
        ro = Rollout(t[0], t[1], t[2], it["prompt_len"], t[3], t[4], m["metas"], m["responses"], t[5], t[6])
        ro.policy_version = torch.full((t[3].numel(),), it["version"], dtype=torch.long, device=t[3].device)
        out.append(StepRollout(it["step"], it["version"], ro, m["stats"]))
    return out
