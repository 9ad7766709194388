"""The RL step: rollout, old/reference log-probs, advantages, clipped updates, KL control.

One `RLTrainer.step()`, each phase in its own file:
  1. rollout      -- this DP rank's prompts, G samples each, scored (rl/experience/rollout.py)
  2. ref log-probs -- the frozen reference's hidden states and head weight, then its log-probs
  3. old log-probs -- policy, no grad, through the fused head (+ entropy, + exact KL if asked)
  4. KL per token  -- exact full-vocabulary KL or a sampled estimator; into the reward (PPO
                      default) or the loss (GRPO default), scaled by the controller's beta
  5. advantages    -- GRPO group-normalised, or GAE over critic values (PPO); 2-5: rl/update/step_data.py
  6. update        -- `algo.epochs` x `algo.mini_batches` optimizer steps; losses normalised by
                      global counts (rl/objectives/losses.py), so the update does not depend on the DP
                      split (rl/update/update.py)
  7. control       -- beta update, reference sync, then the metrics record with the KL guards
                      (rl/step_record.py)
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from core.runtime.metrics import PhaseTimer, reset_peak_memory
from core.runtime.monitor import Monitor
from rl.config import RLConfig
from rl.distill.metrics import distill_metrics
from rl.experience.dynamic_sampling import collect_step
from rl.experience.episodes import collect_episodes
from rl.experience.rollout import collect_rollout, evaluate, pad_id_of
from rl.models.reference import ReferenceSync
from rl.objectives.controller import EntropyController, KLController
from rl.objectives.kl import masked_mean
from rl.step_record import StepRecorder, balance_beta
from rl.update.logprobs import PolicyHeads
from rl.update.shared_layout import LayoutCost
from rl.update.step_data import ExperienceMaker, StepData
from rl.update.update import PolicyUpdate


class RLTrainer:
    """One GRPO/PPO run's step on this rank: `step(s)` does, in order,
    1. `make_experience`: rollout (G samples per prompt, scored), then `ExperienceMaker`: old log-probs and
       entropy (policy, no grad), reference log-probs (and hidden states for the exact KL), the per-token KL
       with padding replaced, KL into the reward if asked, advantages (GRPO group-normalised, or GAE over
       the critic);
    2. `update`: `PolicyUpdate`'s epochs x mini-batches x micro-batches of `_micro_step` (forward through
       the head with the per-token loss, backward), one optimizer step per mini-batch;
    3. control: beta from the measured KL (clock: samples per step), reference sync, then `StepRecorder`'s
       metrics with the KL guards.
    """

    def __init__(self, cfg: RLConfig, state, policy, reference, optimizer, tokenizer, task, reward_fn,
                 reward_norm, critic=None, critic_optimizer=None, eval_prompts=None, teacher=None):
        """`task`: a prompt source (rl.experience.rollout.TaskPrompts / DataPrompts) or a built-in task; `eval_prompts`:
        the held-out [(ids, meta)] scored every `rollout.eval_every` steps (None: no eval)."""
        self.cfg, self.state = cfg, state
        self.policy, self.ref, self.opt = policy, reference, optimizer
        self.teacher = teacher  # on-policy distillation's frozen teacher (rl/distill), or None
        self.critic, self.critic_opt = critic, critic_optimizer
        self.tok, self.task, self.reward_fn, self.reward_norm = tokenizer, task, reward_fn, reward_norm
        self.controller = KLController(cfg.kl_ctl)
        self.ent_ctl = EntropyController(cfg.loss)
        self.monitor = None
        if state.is_main and (cfg.monitor.tensorboard or cfg.monitor.wandb != "off"):
            self.monitor = Monitor(cfg.train.out_dir, cfg.monitor.tensorboard, cfg.monitor.wandb, asdict(cfg))
        if cfg.kl_ctl.preset and state.is_main:
            print(f"kltron: {cfg.kl_ctl.preset_summary}", flush=True)
        if cfg.recipe_summary and state.is_main:
            print(f"kltron: {cfg.recipe_summary}", flush=True)
        self.ref_sync = ReferenceSync(cfg.reference, cfg.kl_ctl.target)
        # log-probs, entropy and the exact KL (policy and reference alike) are taken over the ids the
        # tokenizer has, the same vocabulary the sampler draws from: a padded embedding's extra rows are
        # never read, so the update is exactly on-policy
        self.vocab = min(policy.cfg.vocab_size, getattr(tokenizer, "vocab_size", None) or policy.cfg.vocab_size)
        self.eval_prompts = eval_prompts or None
        self.tp_group, self.dp_group = state.tp_group, state.dp_group
        self.world_group = None if state.mesh is None else torch.distributed.group.WORLD
        self.layout_cost = LayoutCost.of(policy.cfg)  # the shared-prompt layout's plan (rl/update/shared_layout.py)
        self.timer = PhaseTimer(state.device, memory={"rollout": "rollout", "ref_logprobs": "ref",
                                                      "old_logprobs": "old", "update": "update"})
        self.rollout_stats: dict = {}  # this rank's last generation: rollout_tokens, rollout_s
        if cfg.algo.name == "ppo" and critic is None:
            raise ValueError("algo.name='ppo' needs a critic")
        temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.heads = PolicyHeads(self.tp_group, self.vocab, temperature, cfg.algo.kl_chunk_size)
        self.experience = ExperienceMaker(cfg, policy=policy, reference=reference, critic=critic,
                                          reward_norm=reward_norm, controller=self.controller, heads=self.heads,
                                          layout_cost=self.layout_cost, timer=self.timer, dp_group=self.dp_group,
                                          device=state.device, teacher=teacher)
        self.updater = PolicyUpdate(cfg, policy=policy, optimizer=optimizer, critic=critic,
                                    critic_optimizer=critic_optimizer, controller=self.controller,
                                    ent_ctl=self.ent_ctl, heads=self.heads, layout_cost=self.layout_cost,
                                    dp_group=self.dp_group, device=state.device, grad_group=state.grad_group)
        self.recorder = StepRecorder(cfg, vocab=self.vocab, timer=self.timer, rollout_stats=self.rollout_stats,
                                     dp_group=self.dp_group, device=state.device)

    @torch.no_grad()
    def make_experience(self, step: int) -> StepData:
        """Steps 1-5: this rank's rollout (G samples per prompt, scored), then what the update needs of
        it (rl/update/step_data.py)."""
        cfg, st = self.cfg, self.state
        def collect(key: int):
            if cfg.rollout.env:  # multi-turn episodes against an environment (rl/experience/episodes.py)
                return collect_episodes(self.policy, self.tok, self.task, cfg.rollout, seed=cfg.train.seed, step=key,
                                        dp_rank=st.dp_rank, dp_size=st.dims.dp, tp_group=self.tp_group,
                                        dp_group=self.dp_group, device=st.device, world_group=self.world_group,
                                        stats=self.rollout_stats, timeout_s=cfg.reward.timeout_s)
            return collect_rollout(self.policy, self.tok, self.task, self.reward_fn, cfg.rollout, seed=cfg.train.seed,
                                   step=key, dp_rank=st.dp_rank, dp_size=st.dims.dp, tp_group=self.tp_group,
                                   dp_group=self.dp_group, device=st.device, world_group=self.world_group,
                                   stats=self.rollout_stats)
        with self.timer("rollout"):  # DAPO's overlong shaping and dynamic sampling when algo asks for them
            ro, self.rollout_stats["recipe_metrics"] = collect_step(
                collect, cfg, step, tokenizer=self.tok, pad_id=pad_id_of(self.tok), dp_rank=st.dp_rank,
                dp_group=self.dp_group, stats=self.rollout_stats)
            if cfg.rollout.env:  # env_turns, tool_calls, tool_call_success (global over DP) into the record
                self.rollout_stats["recipe_metrics"] = {**(self.rollout_stats["recipe_metrics"] or {}),
                                                        **self.rollout_stats.get("env_metrics", {})}
        return self.experience.make_experience(ro, step)

    def update(self, data: StepData, step: int) -> dict:
        """Step 6, the policy (and critic) update on this step's rollouts (rl/update/update.py)."""
        return self.updater.update(data, step)

    def evaluate(self, step: int) -> dict:
        """The held-out eval (rl.experience.rollout.evaluate) when it is due before `step` ({} otherwise): every
        `rollout.eval_every` steps and before the run's last step."""
        ro, st = self.cfg.rollout, self.state
        due = ro.eval_every and (step % ro.eval_every == 0 or step == self.cfg.train.steps - 1)
        if not self.eval_prompts or not due:
            return {}
        with self.timer("eval"):
            run = lambda model: evaluate(model, self.tok, self.eval_prompts, self.reward_fn, ro,  # noqa: E731
                                         seed=self.cfg.train.seed, step=step, dp_rank=st.dp_rank, dp_size=st.dims.dp,
                                         tp_group=self.tp_group, dp_group=self.dp_group, device=st.device,
                                         world_group=self.world_group)
            out = run(self.policy)
            if self.teacher is not None and step == 0:  # what the student is distilled toward, once
                out["teacher_eval_pass1"] = run(self.teacher)["eval_pass1"]
            return out

    def step(self, step: int) -> dict:
        """Step `step`: the due eval, experience, the update, KL control and reference sync; returns its
        metrics record (rl/step_record.py). The models, optimizers and controllers are shared with the
        pieces built in `__init__` (replace none of them on the trainer after it is built)."""
        cfg = self.cfg
        reset_peak_memory(self.state.device)
        evals = self.evaluate(step)  # the policy before this step's update, outside the step's clock
        t0 = time.perf_counter()
        data = self.make_experience(step)
        grads = balance_beta(cfg, self.controller, data, self.dp_group)
        ent_coef = self.ent_ctl.coef
        with self.timer("update"):
            upd = self.update(data, step)
        # the exact KL where a truncated sampler makes the sampled estimate misread KL(pi||ref) (StepData)
        kl_mean = float(masked_mean(data.kl_for_control, data.mask, dp_group=self.dp_group))
        beta = self.controller.beta
        # Ziegler et al.'s clock: the KL was measured on this many samples (global); horizon is in samples
        new_beta = self.controller.update(kl_mean, n_samples=cfg.rollout.prompts_per_step * cfg.rollout.group_size)
        synced = self.ref_sync.maybe_sync(step, kl_mean, self.policy, self.ref, self.opt)
        rec = self.recorder.record(step, data, upd, t0=t0, kl_mean=kl_mean, beta=beta, new_beta=new_beta,
                                   ent_coef=ent_coef, grads=grads, synced=synced, evals=evals)
        if data.teacher_logp is not None:
            rec.update(distill_metrics(cfg, data, upd, step, self.dp_group))
        self.ent_ctl.update(rec["entropy"])
        if self.monitor is not None:
            self.monitor.log(rec, step)
        return rec
