"""The rollout ranks' loop (rl/pipeline): wait for the weights a step needs, generate, send.

A rollout rank holds the policy only (no reference, critic or optimizer), sharded over its own
`parallel.rollout_tp`, with the rollout ranks' DP ranks each generating their share of a step's
prompts exactly as a colocated DP rank would (same prompts, same noise keyed by (seed, step, row)).
Its weights come only from the trainer (rl/pipeline/weight_sync.py); it reads no checkpoint.

Step by step, for s = first_step .. train.steps - 1: receive weights until it holds version
`need(s)` (rl/pipeline/schedule.py), generate and score the rollout of s, and send it: DP ranks to
the rollout leader (rollout rank 0), which concatenates the rows and sends each trainer rank its DP
share (rl/pipeline/channel.py). Sends do not block: with max_staleness k the leader runs up to k
steps ahead of the update. A STOP message (the run ends early) ends the loop.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

import core.ckpt as ckpt
from core.config import ModelConfig, from_dict
from core.model import Transformer
from core.runtime.lifecycle import RankStalled, is_comm_failure
from core.tokenizer import load_tokenizer
from rl.experience.dynamic_sampling import collect_step
from rl.experience.episodes import collect_episodes
from rl.experience.prompts import load_prompt_data
from rl.experience.rewards import build_reward
from rl.experience.rollout import collect_rollout, pad_id_of
from rl.pipeline import channel
from rl.pipeline.schedule import need
from rl.pipeline.weight_sync import STOP, recv_header, recv_weights


class RolloutWorker:
    """The policy copy, prompt source and reward of one rollout rank."""

    def __init__(self, cfg, layout, hooks, trainer_dims):
        self.cfg, self.layout, self.st, self.trainer_dims = cfg, layout, layout.state, trainer_dims
        self.tok = load_tokenizer(hooks.tokenizer_path(cfg))
        model_cfg = from_dict(ModelConfig, ckpt.read_manifest(cfg.init.start_checkpoint)["model_config"])
        st = self.st
        self.policy = Transformer(model_cfg, st.tp_group, layout.kv_group, device="meta").to_empty(device=st.device)
        self.policy.set_mixed_precision(cfg.parallel.precision(st.device.type))
        self.policy.batch_invariant = cfg.parallel.batch_invariant
        self.policy.eval()
        task, self.reward_fn, _ = build_reward(cfg.reward)
        data = load_prompt_data(cfg.data, self.tok) if cfg.data is not None else None
        self.source, _ = hooks.prompt_sources(cfg, self.tok, task, data, model_cfg.max_seq_len)
        # no final hidden states: the trainer recomputes the old log-probs on its newer weights
        self.ro_cfg = replace(cfg.rollout, record_hidden=False)
        self.version = -1

    @torch.no_grad()
    def generate(self, step: int) -> channel.StepRollout:
        """This rank's scored rollout of `step` (overlong shaping and dynamic sampling as configured)."""
        cfg, st, stats = self.cfg, self.st, {}
        common = dict(seed=cfg.train.seed, dp_rank=st.dp_rank, dp_size=st.dims.dp, tp_group=st.tp_group,
                      dp_group=st.dp_group, device=st.device, world_group=st.group, stats=stats)

        def collect(key: int):
            if cfg.rollout.env:
                return collect_episodes(self.policy, self.tok, self.source, self.ro_cfg, step=key,
                                        timeout_s=cfg.reward.timeout_s, **common)
            return collect_rollout(self.policy, self.tok, self.source, self.reward_fn, self.ro_cfg, step=key, **common)
        t0 = time.perf_counter()
        ro, recipe = collect_step(collect, cfg, step, tokenizer=self.tok, pad_id=pad_id_of(self.tok),
                                  dp_rank=st.dp_rank, dp_group=st.dp_group, stats=stats)
        if cfg.rollout.env:
            recipe = {**(recipe or {}), **stats.get("env_metrics", {})}
        stats = {"rollout_s": stats.get("rollout_s", time.perf_counter() - t0),
                 "rollout_tokens": int(stats.get("rollout_tokens", 0)), "recipe_metrics": recipe}
        return channel.StepRollout(step, self.version, ro, stats)

    def run(self, dog) -> None:
        """Receive the first weights (and the step to start at), then generate until the last step or STOP."""
        lay, st, k = self.layout, self.st, self.cfg.algo.max_staleness
        pending: list = []
        where = "waiting for the first weights"

        def lost(err) -> str:  # `where` as it is when called: by the except below, or by the watchdog's thread
            return (f"{lay.name(lay.global_rank)} lost its peers while {where}: the trainer ranks "
                    f"(ranks 0-{lay.n_trainer - 1}) or another rollout rank stopped or stalled; "
                    f"{dog.explain(err, self.cfg.parallel.timeout_s)}")

        dog.on_frozen = lost
        try:
            head = recv_header(lay.sync_group, st.device)
            if head["kind"] == STOP:
                return
            recv_weights(self.policy, st, lay.sync_group, head)
            v0, first = head["version"], head["first_step"]
            self.version = v0
            for s in range(first, self.cfg.train.steps):
                while self.version < need(s, v0, k):
                    where = f"waiting for weights version {need(s, v0, k)} (for step {s})"
                    dog.beat("weights", s - k)
                    head = recv_header(lay.sync_group, st.device)
                    if head["kind"] == STOP:
                        return
                    recv_weights(self.policy, st, lay.sync_group, head)
                    self.version = head["version"]
                where = f"generating step {s}"
                dog.beat("generate", s - k)
                pending = [w for w in pending if not w[0].is_completed()]
                pending += self._send(self.generate(s))
            where = "sending the last rollouts"
            for w, _ in pending:
                w.wait()
        except RuntimeError as e:
            if isinstance(e, RankStalled) or not is_comm_failure(e):
                raise
            raise RankStalled(lost(e)) from e

    def _send(self, sr: channel.StepRollout) -> list:
        """DP ranks' rows to the leader; the leader's concatenation, in DP shares, to every trainer rank."""
        lay, st = self.layout, self.st
        if st.tp_rank != 0:
            return []
        if st.dp_rank != 0:
            return channel.send(sr, lay.rollout_leader, st.device)
        parts = [sr] + [channel.recv(lay.rollout_leader + d * st.dims.tp, st.device, expect_step=sr.step)
                        for d in range(1, st.dims.dp)]
        full = channel.concat(parts, pad_id_of(self.tok))
        out, t_dims = [], self.trainer_dims
        for r in range(lay.n_trainer):
            out += channel.send(channel.dp_slice(full, r // t_dims.tp, t_dims.dp, self.cfg.rollout.group_size), r,
                                st.device)
        return out
