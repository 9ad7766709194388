"""Policy objectives beside the token-level PPO clip (`loss.policy`): GSPO's sequence-level ratio and CISPO's
clipped importance weight, as per-token losses for the fused head and the unfused path alike.

With A the advantage, r_t = pi(y_t)/pi_old(y_t), eps_l/eps_h = loss.clip_low/clip_high, w_t the aggregation's
per-token weight (rl/objectives/losses.py's `token_weights`, constant along a response in every mode):

| loss.policy | per-token term (summed with weights w_t)                         | source                       |
|-------------|------------------------------------------------------------------|------------------------------|
| ppo         | max(-A r_t, -A clip(r_t, 1-eps_l, 1+eps_h)) (dual clip optional) | Schulman et al. 2017         |
| gspo        | max(-A_i s_i, -A_i clip(s_i, 1-eps_l, 1+eps_h)),                 | GSPO, arXiv 2507.18071, (5)-(7) |
|             | s_i = exp(mean_{t in y_i} log r_t): one ratio and one clip per response |                       |
| gspo_token  | as gspo with s_{i,t} = sg(s_i) pi(y_t)/sg(pi(y_t)): value s_i,   | GSPO, arXiv 2507.18071, (13)-(14) |
|             | gradient s_i grad log pi(y_t); per-token advantages allowed      |                              |
| cispo       | -sg(clip(r_t, 1-eps_l, 1+eps_h)) A log pi(y_t)                    | MiniMax-M1, arXiv 2506.13585, (4) |

GSPO and GSPO-token are one computation: with w_t constant along response i and A_i the same at its tokens,
sum_t w_t f(s_{i,t}) has the value W_i f(s_i) and the gradient w_t f'(s_i) s_i grad log pi(y_t) at each token,
which is the gradient of W_i f(s_i) through s_i = exp(mean_t log r_t) (d s_i / d log pi(y_t) = s_i / |y_i|,
times |y_i| tokens of weight W_i / |y_i|). `gspo` refuses token-varying advantages (GAE, the future KL of
kl.gradient=sequence, REINFORCE++ with the KL in the reward), where GSPO's A_i is undefined; `gspo_token` takes them.

The sequence ratio needs every token's current log-prob before any token's loss: `needs_logprobs` tells the
caller to run the head once without a gradient and hand its log-probs to `prepare` (rl/update/logprobs.py's
fused path reads the micro-batch's hidden states twice, no second trunk forward; the unfused path passes the
log-probs it already has). On-policy (the first mini-batch) s_i = 1 and no pass runs. A response must lie
whole in one micro-batch: every layout keeps rows whole (rl/update/micro_batches.py, shared_layout.py), and a
split one is refused by name.
"""

from __future__ import annotations

import torch

from rl.objectives.losses import PolicyLossConfig, TokenPolicyLoss


def _zero_masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x in fp32 (fp64 kept) with masked positions replaced by 0 before any arithmetic."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.where(m, x.to(dt), torch.zeros((), dtype=dt, device=x.device))


def _bounds(cfg: PolicyLossConfig) -> tuple[float, float]:
    return 1.0 - cfg.clip_low, 1.0 + (cfg.clip_low if cfg.clip_high is None else cfg.clip_high)


class SequenceRatioLoss(TokenPolicyLoss):
    """GSPO (`loss.policy=gspo`) and GSPO-token (`gspo_token`): module docstring. `seq_ids` [B, S] (laid out as
    the other tensors: padded rows or a packed [1, M]) names each token's response; `seq_len` [R] is each
    response's valid-token count over the whole step (indexed by those ids), so a response split across
    micro-batches is caught."""

    def __init__(self, cfg: PolicyLossConfig, weights, mask, old_logp, advantages, *, seq_ids: torch.Tensor,
                 seq_len: torch.Tensor, **kw):
        super().__init__(cfg, weights, mask, old_logp, advantages, **kw)
        m = self.m
        self.sid = torch.where(m, seq_ids.reshape(-1).long(), torch.zeros((), dtype=torch.long, device=m.device))
        self.n_seq = int(seq_len.numel())
        ones = torch.ones(int(m.sum()), dtype=torch.float64, device=m.device)
        self.count = torch.zeros(self.n_seq, dtype=torch.float64, device=m.device).index_add_(0, self.sid[m], ones)
        present = self.count > 0
        if (self.count[present] != seq_len.to(self.count)[present]).any():
            k = int(torch.nonzero(present & (self.count != seq_len.to(self.count))).flatten()[0])
            raise ValueError(f"loss.policy={cfg.policy}: response {k} has {int(self.count[k])} of its "
                             f"{int(seq_len[k])} tokens in this micro-batch: the sequence ratio needs each response "
                             f"whole in one micro-batch (every layout of rl/update/micro_batches.py keeps rows whole)")
        if cfg.policy == "gspo":
            self._check_sequence_advantages(cfg)
        self.seq_lr = torch.zeros(m.numel(), dtype=torch.float64, device=m.device) if self.on_policy else None
        self.needs_logprobs = not self.on_policy

    def _check_sequence_advantages(self, cfg):
        m, a = self.m, self.adv.to(torch.float64)
        big = torch.full((self.n_seq,), float("inf"), dtype=torch.float64, device=m.device)
        lo = big.scatter_reduce(0, self.sid[m], a[m], "amin")
        hi = (-big).scatter_reduce(0, self.sid[m], a[m], "amax")
        bad = torch.isfinite(lo) & (hi != lo)
        if bad.any():
            raise ValueError(f"loss.policy=gspo takes one advantage per response (GSPO's A_i), but response "
                             f"{int(torch.nonzero(bad)[0])}'s tokens carry different ones (PPO's GAE, kl.gradient="
                             f"sequence's future KL, or REINFORCE++ with the KL in the reward): use "
                             f"loss.policy=gspo_token")

    def prepare(self, logp: torch.Tensor) -> None:
        """The current log-probs of every token bound here ([B*S] or the bound shape, detached) -> each token's
        sg(log s_i) = mean log-ratio of its response, clamped to +-loss.log_ratio_clamp."""
        m = self.m
        lr = (_zero_masked(logp.detach().reshape(-1), m).to(torch.float64) - self.old.to(torch.float64))
        lr = torch.where(m, lr, torch.zeros((), dtype=torch.float64, device=m.device))
        sums = torch.zeros(self.n_seq, dtype=torch.float64, device=m.device).index_add_(0, self.sid[m], lr[m])
        mean = (sums / self.count.clamp(min=1)).clamp(-self.cfg.log_ratio_clamp, self.cfg.log_ratio_clamp)
        self.seq_lr = torch.where(m, mean[self.sid], torch.zeros((), dtype=torch.float64, device=m.device))

    def _surrogate(self, logp, old, mm, tokens):
        if self.seq_lr is None:
            raise RuntimeError(f"loss.policy={self.cfg.policy} off-policy: call prepare(logprobs) with every token's "
                               f"current log-prob before the loss (the sequence ratio needs the whole response)")
        lp = _zero_masked(logp, mm)
        dt = lp.dtype
        s = torch.exp(self.seq_lr[tokens].to(dt) + (lp - lp.detach()))  # value s_i, gradient s_i grad log pi
        lo, hi = _bounds(self.cfg)
        adv = self.adv[tokens].to(dt)
        loss1, loss2 = -adv * s, -adv * s.clamp(lo, hi)
        zero = torch.zeros((), dtype=dt, device=lp.device)
        loss = torch.where(mm, torch.maximum(loss1, loss2), zero)
        clipped = (loss2 > loss1) & mm
        log_ratio = torch.where(mm, lp.detach() - old.to(dt), zero)  # the token ratio, for the shared statistics
        return loss, clipped, torch.zeros_like(mm), log_ratio

    def stats(self) -> dict:
        """TokenPolicyLoss's, plus seq_clipfrac (share of responses whose ratio s_i was clipped, i.e. whose
        gradient is 0), seq_ratio_mean/max (of s_i) and valid_seqs, over the responses seen."""
        out = super().stats()
        m = self.m
        seen = self.count > 0
        clipped = torch.zeros(self.n_seq, dtype=torch.float64, device=m.device).index_add_(
            0, self.sid[m], self.rec["clipped"][m])
        s = torch.zeros(self.n_seq, dtype=torch.float64, device=m.device).index_add_(
            0, self.sid[m], (self.seq_lr if self.seq_lr is not None else torch.zeros_like(self.rec["pg"]))[m])
        s = (s / self.count.clamp(min=1)).exp()[seen]
        n = int(seen.sum())
        out.update(seq_clipfrac=float((clipped[seen] > 0).sum()) / max(n, 1),
                   seq_ratio_mean=float(s.mean()) if n else 1.0, seq_ratio_max=float(s.max()) if n else 1.0,
                   valid_seqs=float(n))
        return out


class ClippedISWeightLoss(TokenPolicyLoss):
    """CISPO (`loss.policy=cispo`): -sg(clip(r_t, 1-eps_l, 1+eps_h)) A log pi(y_t) per token. Every token keeps
    its gradient (PPO's clip zeroes it once r_t leaves the range); `clipfrac` is the share of tokens whose weight
    was truncated. The value includes log pi, so `pg_loss` is not comparable with the clipped objectives'."""

    def _surrogate(self, logp, old, mm, tokens):
        lp = _zero_masked(logp, mm)
        dt = lp.dtype
        c = self.cfg.log_ratio_clamp
        log_ratio = torch.where(mm, (lp.detach() - old.to(dt)).clamp(-c, c), torch.zeros((), dtype=dt,
                                                                                         device=lp.device))
        r = torch.exp(log_ratio)
        lo, hi = _bounds(self.cfg)
        w = r.clamp(lo, hi)  # detached: built from lp.detach()
        loss = torch.where(mm, -w * self.adv[tokens].to(dt) * lp, torch.zeros((), dtype=dt, device=lp.device))
        return loss, (w != r) & mm, torch.zeros_like(mm), log_ratio


def make_token_loss(cfg: PolicyLossConfig, weights, mask, old_logp, advantages, *, seq_ids=None, seq_len=None,
                    **kw) -> TokenPolicyLoss:
    """The per-token loss of `cfg.policy`. GSPO's `seq_ids`/`seq_len` (SequenceRatioLoss) default to one response
    per row of the [B, S] `mask`."""
    if cfg.policy == "cispo":
        return ClippedISWeightLoss(cfg, weights, mask, old_logp, advantages, **kw)
    if cfg.policy in ("gspo", "gspo_token"):
        if seq_ids is None:
            m = mask.bool()
            seq_ids = torch.arange(m.shape[0], device=m.device)[:, None].expand(m.shape)
            seq_len = m.sum(-1)
        return SequenceRatioLoss(cfg, weights, mask, old_logp, advantages, seq_ids=seq_ids,
                                 seq_len=seq_len, **kw)
    return TokenPolicyLoss(cfg, weights, mask, old_logp, advantages, **kw)


def sequence_ids(cfg: PolicyLossConfig, mask: torch.Tensor, tok) -> dict:
    """For a sequence-level ratio: {seq_ids: each token's local row id laid out as micro-batch `tok` lays out the
    step's [B, N] tensors, seq_len: each row's valid tokens [B]}; {} for the token-level objectives."""
    if cfg.policy not in ("gspo", "gspo_token"):
        return {}
    m = mask.bool()
    return dict(seq_ids=tok(torch.arange(m.shape[0], device=m.device)[:, None].expand(m.shape)), seq_len=m.sum(-1))
