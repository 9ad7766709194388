"""The RL run's configuration: one dataclass section per component, loaded by core.config."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from parallel.lora import LoRAConfig
from rl.distill.config import DistillConfig, TeacherConfig, guards_off
from rl.distill.config import resolve as resolve_distill
from rl.experience.prompts import PromptDataConfig
from rl.experience.rewards import RewardConfig
from rl.objectives.controller import MAX_N_OVER_HORIZON, KLControllerConfig
from rl.objectives.kl import KLConfig
from rl.objectives.losses import PolicyLossConfig
from rl.objectives.off_policy import OffPolicyConfig, check_off_policy
from rl.recipes import apply_recipe


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8  # global, over all DP ranks
    group_size: int = 4  # samples per prompt (G)
    max_new_tokens: int = 12
    min_new_tokens: int = 0  # no EOS is sampled before a response has this many tokens (0: off)
    temperature: float = 1.0
    top_k: int = 0  # 0: off; else sample among the k largest logits (exact across vocabulary shards)
    top_p: float = 1.0  # nucleus: keep tokens while the mass of strictly larger logits is below top_p
    min_p: float = 0.0  # keep tokens with p >= min_p * max p
    stop: list[str] = field(default_factory=list)  # stop strings (beside the tokenizer's EOS ids)
    share_prefill: bool = True  # prefill each distinct prompt once, its KV cache copied to its G rows
    # keep the rollout's final hidden state of every response token ([B, N, H], 2H bytes a token in bf16,
    # 4H in fp32): the old-log-prob pass then measures the exact KL(rollout || train) per token
    record_hidden: bool = True
    # prompt tokens per prefill forward (whole rows, at least one; 0: all rows at once): bounds the
    # prefill's activations (its MLP's [rows x P, I/tp] tensors) as chunked prefill does in vLLM
    prefill_tokens: int = 16384
    eval_prompts: int = 0  # task prompts: >0 scores this many fixed prompts; data set: caps the eval set (0: all)
    eval_every: int = 10  # held-out eval before steps 0, K, 2K, ... and after the last step (0: never)
    eval_k: int = 0  # >0: also sample k responses per eval prompt (rollout temperature): eval_mean_at_k
    # multi-turn episodes (rl/experience/episodes.py): an environment plug-in ("module:function" or a short
    # name of rl.envs.base.SHORT_NAMES: calculator, guess); null: single-turn responses
    env: str | None = None
    env_args: dict = field(default_factory=dict)  # keywords of the environment factory
    max_turns: int = 1  # model turns per episode (max_new_tokens is per turn)
    max_obs_tokens: int = 16  # tokens of one rendered observation (more: an error naming the prompt)
    max_episode_tokens: int = 0  # response-region tokens per episode, sampled + appended (0: turns x per-turn room)

    @property
    def episode_tokens(self) -> int:
        """The episode's token budget (sampled + appended ids)."""
        return self.max_episode_tokens or self.max_turns * (self.max_new_tokens + self.max_obs_tokens)

    def __post_init__(self):
        for k in ("prompts_per_step", "group_size", "max_new_tokens"):
            if getattr(self, k) < 1:
                raise ValueError(f"rollout.{k} must be >= 1, got {getattr(self, k)}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"rollout.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"rollout.min_p must be in [0, 1), got {self.min_p}")
        if self.eval_every < 0 or self.eval_prompts < 0 or self.eval_k < 0:
            raise ValueError(f"rollout.eval_every, eval_prompts and eval_k must be >= 0, got {self.eval_every}, "
                             f"{self.eval_prompts}, {self.eval_k}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0, got {self.top_k}")
        if isinstance(self.prefill_tokens, bool) or not isinstance(self.prefill_tokens, int) or \
                self.prefill_tokens < 0:
            raise ValueError(f"rollout.prefill_tokens must be an int >= 0 (0: one forward), "
                             f"got {self.prefill_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"rollout.stop must be a list of non-empty strings, got {self.stop!r}")
        if self.max_turns < 1 or self.max_obs_tokens < 0 or self.max_episode_tokens < 0:
            raise ValueError(f"rollout.max_turns must be >= 1 and max_obs_tokens, max_episode_tokens >= 0, got "
                             f"{self.max_turns}, {self.max_obs_tokens}, {self.max_episode_tokens}")
        if self.max_turns > 1 and not self.env:
            raise ValueError("rollout.max_turns > 1 needs rollout.env (the environment that answers each turn)")


ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


@dataclass
class AlgoConfig:
    name: str = "grpo"  # "grpo" | "ppo" | "distill" (on-policy distillation: rl/distill/config.py)
    epochs: int = 1  # passes over each step's rollouts
    mini_batches: int = 1  # optimizer steps per epoch; each mini-batch is split over DP
    micro_batch_size: int = 0  # rows per forward on one rank (gradient accumulation); 0: whole mini-batch
    # >0: micro-batches by tokens instead (rl/update/micro_batches.py): rows sorted by length, grouped while
    # rows x (longest prompt + longest response) <= this, each trimmed to its longest row; with share_prompts
    # prompt groups laid out [R, W] with R x W <= this (rl/update/shared_layout.py)
    micro_batch_tokens: int = 0
    pack_sequences: bool = False  # with micro_batch_tokens: rows concatenated, <= that many tokens per sequence
    # each distinct prompt once, its responses after it, in the ref/old passes and the update
    # (rl/update/shared_layout.py), with row or token-budget micro-batches; None (default): on for GRPO
    # (1.3x faster step at 58M) unless pack_sequences, off for PPO
    share_prompts: bool | None = None
    group_mini_batches: bool = False  # mini-batches of whole prompt groups (global prompt id mod mini_batches)
    adv_std_norm: bool = True  # GRPO: divide by the group's std (Dr. GRPO: false)
    # outcome advantages (rl/objectives/advantages.py): "grpo" (group mean, / std with adv_std_norm), "rloo"
    # (leave-one-out mean), "reinforce_pp" (global whitening over the batch, all DP ranks), "reinforce_pp_baseline"
    # (group mean subtracted, then global whitening); null: "grpo" (algo.name=ppo: GAE over the critic)
    advantage: str | None = None
    # one line for a published algorithm's keys (rl/recipes.py, docs/recipes.md); a key the config sets wins
    recipe: str | None = None
    # DAPO's dynamic sampling (rl/experience/dynamic_sampling.py): drop prompt groups whose rewards are all equal
    # and sample more prompts until every DP rank has its share, at most this many extra rounds
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4
    overlong_filter: bool = False  # DAPO: responses cut at max_new_tokens (no stop) leave the loss
    # DAPO's soft overlong punishment: -overlong_penalty x (length - (max_new_tokens - buffer)) / buffer added to
    # the reward over the last `overlong_buffer` tokens before max_new_tokens (L_cache; 0: off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    gamma: float = 1.0  # PPO GAE
    lam: float = 0.95
    whiten_advantages: bool = True  # PPO
    early_stop_kl: float | None = None  # stop the update epochs once approx KL(old||new) per token exceeds this
    # tokens per chunk of the fused head; null or "auto": chunk x Vp/tp <= 2^25 elements and, above 2^21,
    # chunk <= H/16 (bf16 head; H/8 fp32), in [128, T] (parallel/vocab_stats.py's auto_chunk_size)
    kl_chunk_size: int | str | None = "auto"
    fused_loss: bool = True  # policy loss inside the fused head, gradient formed in forward (no logits recomputed)
    # the first mini-batch of epoch 0 is on-policy: its rows' old log-probs (and entropy, exact KL) are read
    # from its own update forward, and the old-log-prob pass runs over the other rows only (none with one
    # mini-batch); where nothing reads them before the update (kl.where=loss, kl_ctl.mode != grad_ratio),
    # else every row. false: every row in the pass, and `logp_drift` compares the two on those rows
    old_from_update: bool = True
    # samples whose weights are more than this many versions behind the current ones are dropped before the
    # update (rl/update/staleness.py); 0: the synchronous run, every sample drawn by the current weights. With
    # parallel.rollout_ranks > 0 (rl/pipeline) the rollout of step s is generated by the weights after step
    # s - max_staleness (1: one-step-off, generation overlaps the update; 0: each side waits for the other)
    max_staleness: int = 0
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)  # mu != pi_old: rl/objectives/off_policy.py

    def __post_init__(self):
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"algo.max_staleness must be an integer >= 0 (0: synchronous), got {self.max_staleness!r}")
        if self.name not in ("grpo", "ppo", "distill"):
            raise ValueError(f"algo.name must be 'grpo', 'ppo' or 'distill', got {self.name!r}")
        if self.epochs < 1 or self.mini_batches < 1 or self.micro_batch_size < 0 or self.micro_batch_tokens < 0:
            raise ValueError("algo.epochs and algo.mini_batches must be >= 1 and micro_batch_size, "
                             "micro_batch_tokens >= 0")
        if self.micro_batch_size and self.micro_batch_tokens:
            raise ValueError(f"algo.micro_batch_size={self.micro_batch_size} (rows) and algo.micro_batch_tokens="
                             f"{self.micro_batch_tokens} (tokens) both set: set one of them")
        if self.kl_chunk_size == "auto":
            self.kl_chunk_size = None  # the fused heads' "auto"
        if self.kl_chunk_size is not None and (isinstance(self.kl_chunk_size, (str, bool)) or self.kl_chunk_size < 1):
            raise ValueError(f"algo.kl_chunk_size must be a positive integer, null or 'auto', "
                             f"got {self.kl_chunk_size!r}")
        if self.share_prompts is None:
            self.share_prompts = self.name == "grpo" and not self.pack_sequences
        if self.share_prompts and self.pack_sequences:
            raise ValueError("algo.share_prompts=true does not compose with algo.pack_sequences=true (each lays "
                             "rows out its own way): for each prompt once under the token budget keep "
                             "algo.micro_batch_tokens and set algo.pack_sequences=false; to pack rows set "
                             "algo.share_prompts=false")
        if self.advantage is None:
            self.advantage = "gae" if self.name == "ppo" else "grpo"
        if self.advantage not in ADVANTAGES or (self.name == "ppo") != (self.advantage == "gae"):
            raise ValueError(f"algo.advantage must be one of {ADVANTAGES[1:]} for algo.name=grpo (ppo: gae, its "
                             f"critic's), got {self.advantage!r} with algo.name={self.name!r}")
        if self.dynamic_sampling_max_rounds < 0 or self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(f"algo.dynamic_sampling_max_rounds, overlong_buffer and overlong_penalty must be >= 0, "
                             f"got {self.dynamic_sampling_max_rounds}, {self.overlong_buffer}, {self.overlong_penalty}")
        if self.pack_sequences and not self.micro_batch_tokens:
            raise ValueError("algo.pack_sequences=true needs algo.micro_batch_tokens > 0 (the tokens per packed "
                             "sequence)")


@dataclass
class CriticConfig:
    lr: float = 1e-4
    value_clip: float | None = 0.2
    warmup_steps: int = 0


@dataclass
class ReferenceConfig:
    checkpoint: str | None = None  # None: the policy's starting checkpoint
    cpu_offload: bool = False
    sync_every: int = 0  # >0: sync the reference to the policy every K steps
    sync_below: float | None = None  # sync when mean KL stays below this fraction of kl_ctl.target ...
    sync_patience: int = 3  # ... for this many consecutive steps
    sync_mode: str = "hard"  # "hard" copy or "ema" mix
    ema_alpha: float = 0.1  # ref <- (1 - alpha) * ref + alpha * policy
    # reset the policy's AdamW state after a sync; null: yes after a hard sync (the guides' advice: the
    # moments were built against the old reference), no after an EMA mix
    reset_optimizer: bool | None = None
    dtype: str = "fp32"  # "bf16": the reference's weights are stored and computed in bf16 (its KL stays fp32)
    # the policy's own modules with the LoRA adapters switched off (no reference weights); null: yes with lora
    from_policy_base: bool | None = None

    def __post_init__(self):
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"reference.dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        if self.reset_optimizer is None:
            self.reset_optimizer = self.sync_mode == "hard"
        if self.sync_mode not in ("hard", "ema"):
            raise ValueError(f"reference.sync_mode must be 'hard' or 'ema', got {self.sync_mode!r}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"reference.ema_alpha must be in (0, 1], got {self.ema_alpha}")


@dataclass
class MonitorConfig:
    """The `monitor` section: where metrics go beside metrics.jsonl (rank 0; core/runtime/monitor.py)."""

    tensorboard: bool = False  # TensorBoard event files in {train.out_dir}/tensorboard (extra `tensorboard`)
    wandb: str | bool = "off"  # "off" | "offline": a Weights & Biases offline run in {train.out_dir}/wandb
    corr_window: int = 20  # steps in the trainer's reward_kl_corr

    def __post_init__(self):
        if self.wandb is False:  # YAML 1.1 reads a bare `off` as false
            self.wandb = "off"
        if self.wandb not in ("off", "offline"):
            raise ValueError(f"monitor.wandb must be 'off' or 'offline', got {self.wandb!r}")
        if self.corr_window < 3:
            raise ValueError(f"monitor.corr_window must be >= 3, got {self.corr_window}")


MAX_GUARD_PER_TOKEN = 10.0  # a mean KL of 10 nats per token is no healthy run's: larger is a per-sequence value


@dataclass
class GuardConfig:
    """The step's mean KL per response token (nats, the logged `kl_mean`) against two limits; null: off.
    A healthy run's is 0.01-0.4 over 20-step windows (grpo_tiny: 0.09 -> 0.37, single steps up to 0.78), and
    tools.diagnose calls a median of 1 `kl_high`; a single step above 2 is far out, above 5 broken."""

    kl_warn_per_token: float | None = 2.0  # above this: a warning on rank 0
    kl_stop_per_token: float | None = 5.0  # above this: stop the run (after saving)
    kl_warn: float | None = None  # renamed kl_warn_per_token: refused with the new name
    kl_stop: float | None = None  # renamed kl_stop_per_token: refused with the new name

    def __post_init__(self):
        for old in ("kl_warn", "kl_stop"):
            if getattr(self, old) is not None:
                raise ValueError(f"guard.{old} is now guard.{old}_per_token (the mean KL per response token, nats; "
                                 f"default {getattr(GuardConfig, old + '_per_token')}): its old default 20 / 50 "
                                 f"is a per-sequence magnitude, 50-200x a healthy run's per-token KL")
        for k in ("kl_warn_per_token", "kl_stop_per_token"):
            v = getattr(self, k)
            if v is not None and not 0 < v <= MAX_GUARD_PER_TOKEN:
                raise ValueError(f"guard.{k}={v:g} must be in (0, {MAX_GUARD_PER_TOKEN:g}] nats per response token "
                                 f"(null: off); a larger value is a per-sequence KL (a sum over the response)")
        if None not in (self.kl_warn_per_token, self.kl_stop_per_token) and \
                self.kl_warn_per_token > self.kl_stop_per_token:
            raise ValueError(f"guard.kl_warn_per_token={self.kl_warn_per_token:g} is above guard.kl_stop_per_token="
                             f"{self.kl_stop_per_token:g}")


@dataclass
class InitConfig:
    checkpoint: str | None = None  # the policy's starting checkpoint; None: {sft_dir}/model, built if missing
    sft_dir: str = "runs/tiny_sft"  # where the start checkpoint is built by supervised training on the task
    sft_steps: int = 300
    sft_lr: float = 3e-3
    sft_examples: int = 4000  # task examples written to {sft_dir}/task_data.txt
    sft_answer_noise: float = 0.0  # share of those examples given a wrong answer (a noisy demonstration set)
    sft_seq_len: int = 64
    sft_micro_batch_size: int = 16

    @property
    def start_checkpoint(self) -> str:
        import os

        return self.checkpoint or os.path.join(self.sft_dir, "model")


@dataclass
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # for building the start checkpoint only
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    kl_ctl: KLControllerConfig = field(default_factory=KLControllerConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    init: InitConfig = field(default_factory=InitConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=40, out_dir="runs/grpo"))
    data: PromptDataConfig | None = None  # prompts from a JSONL/Parquet file (then reward.task may be null)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: train adapters on a frozen base
    # a tokenizer file or checkpoint folder; None: the start checkpoint's folder when it holds tokenizer
    # files (a converted HF checkpoint), else the shipped sentencepiece model
    tokenizer: str | None = None
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # distillation's frozen teacher
    distill: DistillConfig = field(default_factory=DistillConfig)  # the distillation term (rl/distill/config.py)

    recipe_summary = ""  # what algo.recipe set (rl/recipes.py), printed at start-up

    @classmethod
    def prepare_dict(cls, data: dict) -> tuple[dict, dict]:
        """algo.recipe's keys filled in the config dict where it sets none (rl/recipes.py)."""
        data, summary = apply_recipe(data, RolloutConfig.max_new_tokens)
        return data, {"recipe_summary": summary}

    def __post_init__(self):
        resolve_distill(self.distill, self.teacher, self.algo.name)
        guards_off(self)  # pure distillation: the "reference" KL is the KL to the teacher, the objective
        if self.data is None and self.reward.task is None:
            raise ValueError("reward.task is null and there is no data section: set one of them (prompts come from "
                             "the built-in task or from data.train_file)")
        n = self.rollout.prompts_per_step * self.rollout.group_size  # samples per step: the controller's clock
        self._resolve_algo_defaults()
        check_off_policy(self)  # algo.off_policy / algo.max_staleness against the KL's place and weight
        self._resolve_lora_reference()
        if self.kl_ctl.horizon_steps is not None:  # a horizon in steps, converted to Ziegler's samples
            if "horizon" in self.kl_ctl.user_keys and self.kl_ctl.horizon != self.kl_ctl.horizon_steps * n:
                raise ValueError(f"kl_ctl.horizon={self.kl_ctl.horizon} (samples) and kl_ctl.horizon_steps="
                                 f"{self.kl_ctl.horizon_steps} (x {n} samples per step) are both set and disagree: "
                                 f"set one of them")
            self.kl_ctl.horizon = self.kl_ctl.horizon_steps * n
        if self.kl_ctl.mode == "adaptive" and not n / self.kl_ctl.horizon < MAX_N_OVER_HORIZON:
            raise ValueError(f"kl_ctl.horizon={self.kl_ctl.horizon} is in samples and a step has "
                             f"rollout.prompts_per_step x rollout.group_size = {n}: n / horizon must be < "
                             f"{MAX_N_OVER_HORIZON:g} (else beta can be driven to 0); use kl_ctl.horizon > "
                             f"{n / MAX_N_OVER_HORIZON:g}")

    def _resolve_lora_reference(self):
        """reference.from_policy_base: on by default with LoRA; it needs LoRA and excludes a reference of its own."""
        ref, lora = self.reference, self.lora
        if ref.from_policy_base is None:
            ref.from_policy_base = lora.enabled
        if not ref.from_policy_base:
            if lora.enabled and (ref.sync_every or ref.sync_below is not None):
                raise ValueError("reference.sync_every / sync_below with lora.rank > 0 and a separate reference: "
                                 "copying the policy's frozen base into it changes nothing; use "
                                 "reference.from_policy_base=true (a sync merges the adapters into the base)")
            return
        if not lora.enabled:
            raise ValueError("reference.from_policy_base=true is the policy with its LoRA adapters off: it needs "
                             "lora.rank > 0")
        for key, bad in (("checkpoint", ref.checkpoint is not None), ("cpu_offload", ref.cpu_offload),
                         ("dtype", ref.dtype != "fp32")):
            if bad:
                raise ValueError(f"reference.{key}: the reference is the policy's base (reference.from_policy_base="
                                 f"true), it has no weights of its own; unset reference.{key} or set "
                                 f"reference.from_policy_base=false")
        if ref.sync_mode == "ema" and (ref.sync_every or ref.sync_below is not None):
            raise ValueError("reference.sync_mode=ema with reference.from_policy_base=true: the base cannot move "
                             "part-way towards the adapted policy without becoming a second model; use "
                             "reference.sync_mode=hard (merge the adapters into the base and reset them) or "
                             "reference.from_policy_base=false")

    def _resolve_algo_defaults(self):
        """kl.where='auto' (the default): PPO puts the KL in the reward per token (Ziegler et al., InstructGPT,
        TRL's PPOTrainer) with the estimator k1, GRPO in the loss (DeepSeekMath) with k3+
        (rl/objectives/kl_place.py)."""
        if getattr(self.kl, "where_auto", False):
            self.kl.place("reward" if self.algo.name == "ppo" else "loss")
        if self.kl_ctl.mode == "grad_ratio" and (self.kl.where != "loss" or self.kl.exact):
            raise ValueError(f"kl_ctl.mode='grad_ratio' balances the KL term of the loss against the policy "
                             f"gradient: it needs kl.where='loss' and a sampled estimator (kl.exact=false), got "
                             f"kl.where={self.kl.where!r}, kl.exact={self.kl.exact}")
        self._check_recipe_keys()
        if self.kl_ctl.mode == "grad_ratio" and self.kl.gradient == "sequence":
            raise ValueError("kl_ctl.mode='grad_ratio' weighs the KL loss term's gradient alone: it does not see "
                             "kl.gradient='sequence''s future-KL part of the advantages; use kl.gradient='token'")

    def _check_recipe_keys(self):
        """The keys of rl/recipes.py's algorithms that only make sense together."""
        a, lo, ro = self.algo, self.loss, self.rollout
        token_adv = a.name == "ppo" or (self.kl.where == "loss" and self.kl.gradient == "sequence") or \
            (a.advantage.startswith("reinforce_pp") and self.kl.where == "reward")
        if lo.policy == "gspo" and token_adv:
            raise ValueError("loss.policy=gspo takes one advantage per response (GSPO's A_i); these settings give "
                             "each token its own (algo.name=ppo's GAE, kl.gradient=sequence in the loss, or "
                             "REINFORCE++ with kl.where=reward): use loss.policy=gspo_token")
        if lo.policy != "ppo" and lo.dual_clip is not None:
            raise ValueError(f"loss.dual_clip is PPO's (loss.policy=ppo); loss.policy={lo.policy} has its own clip")
        if a.advantage == "rloo" and ro.group_size < 2:
            raise ValueError("algo.advantage=rloo needs rollout.group_size >= 2 (the others of a group are the "
                             "baseline)")
        if a.overlong_buffer >= ro.max_new_tokens:
            raise ValueError(f"algo.overlong_buffer={a.overlong_buffer} must be below rollout.max_new_tokens="
                             f"{ro.max_new_tokens} (the punishment ramps over the last overlong_buffer tokens)")
        if ro.env and (a.overlong_buffer or a.dynamic_sampling):
            raise ValueError("rollout.env (multi-turn episodes) with algo.overlong_buffer or algo.dynamic_sampling: "
                             "both read single-turn responses (max_new_tokens, one generate per round); turn them off")
        if a.dynamic_sampling and (a.name != "grpo" or ro.group_size < 2):
            raise ValueError("algo.dynamic_sampling drops prompt groups with equal rewards: it needs algo.name=grpo "
                             "and rollout.group_size >= 2")
