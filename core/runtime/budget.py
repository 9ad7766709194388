"""The RL step's memory per rank as a stacked budget: pure arithmetic on a ModelConfig, a layout
(tp x cp x dp, sequence parallelism, FSDP, activation checkpointing), a batch and the dtypes. Nothing is allocated.

| part             | bytes per rank                                                                      |
|------------------|-------------------------------------------------------------------------------------|
| policy weights   | fp32 master parameters, P_tp / (dp cp) (FSDP) or P_tp, P_tp = the rank's TP        |
|                  | slice (heads, MLP columns, vocabulary rows Vp/tp); + 2 gathered bf16 layers (FSDP)  |
| gradients        | like the weights (fp32)                                                             |
| AdamW state      | exp_avg + exp_avg_sq, 2 x the weights (fp32)                                        |
| activations      | saved per layer per token: A = 6H + 2 q + 4 kv + 4 I/tp elements (see `layer_act`); |
|                  | L x A x rows x S, or with checkpointing L x H x rows x S + one layer's A x rows x S |
|                  | split in two parts: "sequence activations" (the norms' 4H, the projections' 2H, the |
|                  | checkpointed block inputs; / tp under sequence parallelism) and "activations" (the |
|                  | rest); with cp the tokens are rows x S / cp, plus "CP attention" buffers           |
|                  | (core/runtime/budget_seq.py)                                                        |
| KL head          | by method: gather ~7 [T, Vp] fp32; vp_materialized ~6 [T, Vp/tp]; fused ~6 chunk    |
|                  | x Vp/tp fp32 + grad hidden [T, H] (the tools.kl_memory projections, checked there); |
|                  | fused with bf16 compute: + the fp32 accumulator of the head's weight gradient       |
|                  | [Vp/tp, H] (parallel/fused.py's GradAccumulator; the gradient keeps its storage);   |
|                  | fused_loss (the trainer's update head): 2 chunk buffers (3 with the exact KL, or the |
|                  | rollout-KL pass's 3 with rollout.record_hidden) + grad hidden; update tokens with    |
|                  | shared prompts: each prompt once, then every row's response                          |
| rollout KV cache | 2 x L x rows x S x kv_local x hd in the compute dtype (alive in the rollout phase)  |
| rollout hidden   | rollout.record_hidden: rows x N x H in the compute dtype, from the rollout to the    |
|                  | end of the update (the old pass's exact KL(rollout || train) reads it)              |
| rollout work     | the larger of one prefill block's forward transients (rollout.prefill_tokens, whole  |
|                  | rows) and a decode position's [rows, Vp/tp] logits + two fp32 temporaries (sampler, |
|                  | recorded log-prob) plus                                                              |
|                  | one layer's K (or V) copy when finished rows are compacted                           |
| reference        | by placement: replicated P, tp P_tp, tp_fsdp P_tp / dp + 2 gathered layers,          |
|                  | cpu_offload 2 layers on the device (+ a host->device copy of P_tp per forward);     |
|                  | EMA-synced bf16/fp16 reference: + its fp32 master copy, 4 bytes per weight of the   |
|                  | rank's shard (rl/models/reference.py), on the host with cpu_offload                         |

Three phases peak separately: rollout (weights, optimizer state, reference, KV cache, rollout work), experience
(weights, optimizer state, the reference's no-grad forward: its weights plus one layer's
transients and the copy of its head weight that reference_hidden keeps; then the policy's old-log-prob
pass beside that copy, its fused head's logits buffers) and update (weights,
optimizer state, reference, then the larger of activations + KL head + the head's gradient and all
gradients, plus with tied embeddings the embedding's dense gradient: backward frees activations as
it makes gradients); the
step's peak is the largest. Checked against MemTracker peaks of bench/bench_rl_step.py in tests/test_budget.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ModelConfig
from core.runtime.budget_seq import activation_parts, cp_attention_bytes
from parallel.vocab_stats import resolve_chunk_size

PLACEMENTS = ("replicated", "tp", "tp_fsdp", "cpu_offload", "policy_base")  # policy_base: LoRA's adapters off
KL_METHODS = ("gather", "vp_materialized", "fused", "fused_loss")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PCIE_BYTES_PER_S = 25e9  # host->device, PCIe 4 x16 in practice


@dataclass
class Layout:
    tp: int = 1
    dp: int = 1
    fsdp: bool = True
    compute_dtype: str = "fp32"  # "bf16": bf16 compute copies, fp32 master weights and optimizer
    activation_checkpointing: bool = False
    sp: bool = False  # parallel.sequence_parallel (inside TP)
    cp: int = 1  # context parallel ranks: the sequence split over cp, FSDP over dp x cp
    cp_impl: str = "ulysses"  # "ulysses" | "ring": which attention buffers CP adds

    @property
    def fsdp_shards(self) -> int:
        """Ranks a parameter is sharded over: dp x cp with FSDP, else 1."""
        return self.dp * self.cp if self.fsdp and self.dp * self.cp > 1 else 1


@dataclass
class Batch:
    rollout_rows: int  # sequences generated on this rank at once
    update_rows: int  # rows per forward+backward of the update (a micro-batch)
    seq_len: int  # prompt + response tokens
    response_len: int  # tokens the KL head sees per row
    kl_chunk: int | None = None  # tokens per fused-head chunk; None: "auto" (parallel/vocab_stats.py's rule)
    prefill_tokens: int = 16384  # rollout.prefill_tokens: prompt tokens per prefill forward (0: all rows)
    rows_per_prompt: int = 1  # rows sharing one prefill (rollout.share_prefill: the group size G)
    rollout_hidden: bool = False  # rollout.record_hidden: the sampled tokens' final hidden states are kept
    group_size: int = 1  # with shared_prompts: responses per prompt (rollout.group_size)
    shared_prompts: bool = False  # algo.share_prompts: each prompt once per micro-batch, its responses after it
    old_rows: int | None = None  # rows of the old-log-prob pass (None: rollout_rows; algo.old_from_update defers some)

    def update_tokens(self) -> int:
        """Tokens one update forward runs: rows x seq_len, or with shared prompts each distinct prompt once
        (rl/update/shared_layout.py): ceil(rows / G) prompts of seq_len - response_len tokens plus every
        row's response."""
        if not self.shared_prompts:
            return self.update_rows * self.seq_len
        prompts = -(-self.update_rows // max(self.group_size, 1))
        return prompts * (self.seq_len - self.response_len) + self.update_rows * self.response_len


def param_counts(cfg: ModelConfig, tp: int) -> dict[str, int]:
    """Parameters on one TP rank: 'layer' (one decoder layer), 'vocab' (embedding + head rows
    Vp/tp each), 'total'."""
    H, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.n_heads * hd // tp, max(cfg.n_kv_heads // tp, 1) * hd
    layer = H * (q + 2 * kv) + q * H + 3 * H * I // tp + 2 * H + (q + 2 * kv if cfg.qkv_bias else 0)
    vp = cfg.padded_vocab_size(tp) // tp
    vocab = vp * H * (1 if cfg.tie_embeddings else 2)
    return {"layer": layer, "vocab": vocab, "total": cfg.n_layers * layer + vocab + H}


def layer_act(cfg: ModelConfig, tp: int) -> int:
    """Elements saved for backward per token by one decoder layer: the two RMSNorms (input and its
    fp32 normalised copy, 2H each), the projections' input (H) and the residual (H); q, k, v before
    and after RoPE (2q + 4kv); the MLP's gate, up, silu(gate) and their product (4 I/tp)."""
    hd = cfg.head_dim
    q, kv = cfg.n_heads * hd // tp, max(cfg.n_kv_heads // tp, 1) * hd
    return 6 * cfg.hidden_size + 2 * q + 4 * kv + 4 * cfg.intermediate_size // tp


def kl_head_bytes(method: str, tokens: int, cfg: ModelConfig, tp: int, chunk: int, act_bytes: int,
                  exact: bool = False, rollout_kl: bool = False) -> int:
    """Extra bytes of the KL term's head on one rank (logits and their temporaries, grad hidden).
    "fused_loss" (the trainer's default update head, parallel/fused_loss.py: the loss inside, its gradient
    formed in forward) holds the policy's [chunk, Vp/tp] fp32 logits, the reference's with the exact KL
    (`exact`), one temporary and a bool mask; `rollout_kl` (rollout.record_hidden) adds the first
    mini-batch's no-grad exact KL(rollout || policy) head on the same hidden states, after the loss
    head: policy logits, rollout logits, one temporary. The larger of the two passes counts."""
    vp = cfg.padded_vocab_size(tp)
    grad_hidden = tokens * cfg.hidden_size * act_bytes
    if method == "gather":
        return 7 * tokens * vp * 4 + grad_hidden
    if method == "vp_materialized":
        return 6 * tokens * vp // tp * 4 + grad_hidden
    if method == "fused":
        # a bf16/fp16 head's weight gradient is summed over the chunks in fp32 (parallel/fused.py)
        accumulator = vp // tp * cfg.hidden_size * 4 if act_bytes < 4 else 0
        return (6 * head_chunk(chunk, tokens, vp // tp, cfg.hidden_size, act_bytes) * vp // tp * 4 + grad_hidden
                + accumulator)
    if method == "fused_loss":
        c = head_chunk(chunk, tokens, vp // tp, cfg.hidden_size, act_bytes) * vp // tp
        loss_head = (2 + exact) * c * 4 + c  # logits (+ the reference's), one temporary, the keep mask
        rollout = 3 * c * 4 if rollout_kl else 0
        accumulator = vp // tp * cfg.hidden_size * 4 if act_bytes < 4 else 0
        return max(loss_head, rollout) + grad_hidden + accumulator
    raise ValueError(f"kl method {method!r}: choose from {KL_METHODS}")


def head_chunk(chunk: int | None, tokens: int, width: int, hidden: int, itemsize: int) -> int:
    """Tokens per fused-head chunk of a head [width = Vp/tp, hidden] with `itemsize`-byte weights: `chunk`
    (None: auto_chunk_size(tokens, width, hidden, itemsize), the fused heads' rule), at most tokens."""
    return min(resolve_chunk_size(chunk, tokens, width, hidden, itemsize), max(tokens, 1))


def reference_bytes(placement: str, cfg: ModelConfig, lay: Layout, ref_bytes: int,
                    ema_master: bool = False) -> tuple[int, float]:
    """(device bytes of the frozen reference, seconds of host->device copy per reference forward).
    `ema_master`: the reference is EMA-synced and stored in 2-byte weights, so rl/models/reference.py keeps an
    fp32 copy of its shard (4 bytes per weight of the rank's shard; on the host with cpu_offload)."""
    pc = param_counts(cfg, lay.tp)
    gathered = 2 * pc["layer"] * ref_bytes  # FSDP / offload: the layer in use and the prefetched one
    master = 4 if ema_master and ref_bytes < 4 else 0  # bytes per weight of the shard
    if placement == "replicated":
        return param_counts(cfg, 1)["total"] * (ref_bytes + master), 0.0
    if placement == "tp":
        return pc["total"] * (ref_bytes + master), 0.0
    if placement == "tp_fsdp":
        return -(-pc["total"] // (lay.dp * lay.cp)) * (ref_bytes + master) + gathered, 0.0
    if placement == "cpu_offload":
        return gathered + pc["vocab"] * ref_bytes, pc["total"] * ref_bytes / PCIE_BYTES_PER_S
    if placement == "policy_base":  # the policy's frozen base with its LoRA adapters off: no weights of its own
        return 0, 0.0
    raise ValueError(f"reference placement {placement!r}: choose from {PLACEMENTS}")


def lora_params(cfg: ModelConfig, tp: int, rank: int, targets, norms: bool = False) -> int:
    """LoRA adapter parameters on one TP rank (parallel/lora.py): A [r, in] and B [out, r] of every
    target in every layer, a column layer's B and a row layer's A split over tp, the other factor whole;
    `norms` (lora.train_norms): a delta [H], replicated over tp, on each block's two norms and the final one."""
    H, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.n_heads * hd // tp, max(cfg.n_kv_heads // tp, 1) * hd
    per = {"q": H + q, "k": H + kv, "v": H + kv, "o": q + H, "gate": H + I // tp, "up": H + I // tp,
           "down": I // tp + H}
    return cfg.n_layers * rank * sum(per[t] for t in targets) + ((2 * cfg.n_layers + 1) * H if norms else 0)


def step_budget(cfg: ModelConfig, lay: Layout, batch: Batch, placement: str = "tp", kl_method: str = "fused",
                ref_dtype: str | None = None, ref_ema: bool = False, lora_rank: int = 0,
                lora_targets=("q", "k", "v", "o", "gate", "up", "down"), exact_kl: bool = False,
                lora_norms: bool = False) -> dict:
    """{'parts': {name: bytes}, 'rollout_peak', 'experience_peak', 'reference_forward_peak', 'update_peak',
    'peak', 'offload_s_per_forward'} per rank. `ref_ema`: the reference is EMA-synced (reference_bytes).
    `lora_rank` > 0: the base is frozen (its weights stay, no gradient, no AdamW state) and only the fp32
    adapters have gradients and AdamW state; with placement "policy_base" the reference costs nothing."""
    pc = param_counts(cfg, lay.tp)
    act_b = DTYPE_BYTES[lay.compute_dtype]
    shard = lay.fsdp_shards
    master = -(-pc["total"] // shard) * 4
    gathered = 2 * pc["layer"] * act_b if (shard > 1 or act_b != 4) else 0
    tok = -(-batch.update_tokens() // lay.cp)  # this rank's tokens (context parallel: 1/cp)
    other, seq = activation_parts(cfg, lay, tok, act_b, lora=lora_rank > 0)
    cp_attn = cp_attention_bytes(cfg, lay, tok, act_b)
    acts = other + seq + cp_attn
    kv = max(cfg.n_kv_heads // lay.tp, 1) * cfg.head_dim
    kv_cache = 2 * cfg.n_layers * batch.rollout_rows * batch.seq_len * kv * act_b
    ref, offload_s = reference_bytes(placement, cfg, lay, DTYPE_BYTES[ref_dtype or lay.compute_dtype], ref_ema)
    head_tok = -(-batch.update_rows * batch.response_len // lay.cp)
    head = kl_head_bytes(kl_method, head_tok, cfg, lay.tp, batch.kl_chunk, act_b, exact=exact_kl,
                         rollout_kl=batch.rollout_hidden)
    parts = {"policy weights": master + gathered, "gradients": master, "AdamW state": 2 * master,
             "activations": other, "sequence activations": seq, "CP attention": cp_attn, "KL head": head,
             "rollout KV cache": kv_cache, "rollout work": rollout_work(cfg, lay.tp, batch, act_b, kv_cache),
             "reference": ref,
             "rollout hidden": batch.rollout_rows * batch.response_len * cfg.hidden_size * act_b
             if batch.rollout_hidden else 0}
    head_grad = -(-pc["vocab"] // shard) * 4 // (1 if cfg.tie_embeddings else 2)
    # tied embeddings: the embedding's backward (the last) makes a dense [Vp/tp, H] gradient that
    # meets the head's, already in the shared .grad, and autograd adds the two out of place: two
    # more vocabulary-table gradients (measured: MemTracker's Temp = 3 of them at the peak)
    tied_extra = 2 * head_grad if cfg.tie_embeddings else 0
    if lora_rank:  # frozen base: no head or embedding gradient; adapters' fp32 gradients and AdamW state
        adapter = -(-lora_params(cfg, lay.tp, lora_rank, lora_targets, lora_norms) // shard) * 4
        parts.update({"policy weights": master + gathered + adapter, "gradients": adapter,
                      "AdamW state": 2 * adapter})
        head_grad = tied_extra = 0
    kept = parts["rollout hidden"]  # alive in every phase from the rollout's end
    rollout = parts["policy weights"] + parts["AdamW state"] + ref + kv_cache + parts["rollout work"] + kept
    # backward frees activations as it makes gradients: the head's transients meet the head's gradient
    # only (the first made), the full gradients meet no activations; the larger of the two is the top
    vp_local = cfg.padded_vocab_size(lay.tp) // lay.tp
    # the exact KL in the loss: the reference's hidden states [rows, N, H] and its head copy [Vp/tp, H], made in
    # the experience phase (rl/update/step_data.py), stay alive through the update, where the loss head reads them
    exact_kept = ((batch.rollout_rows * batch.response_len + vp_local) * cfg.hidden_size
                  * DTYPE_BYTES[ref_dtype or lay.compute_dtype]) if exact_kl else 0
    update = (parts["policy weights"] + parts["AdamW state"] + ref + kept + exact_kept
              + max(acts + head + head_grad, parts["gradients"] + tied_extra))
    # the reference's no-grad pass (experience phase): the copy of its head weight [Vp/tp, H] that
    # rl/update/logprobs.py's reference_hidden keeps, plus the larger of one layer's forward transients and
    # its log-probs by the fused head: one [chunk, Vp/tp] fp32 logits tensor (statistics in place)
    ref_b = DTYPE_BYTES[ref_dtype or lay.compute_dtype]
    ref_head_copy = vp_local * cfg.hidden_size * ref_b
    ref_logits = head_chunk(batch.kl_chunk, head_tok, vp_local, cfg.hidden_size, ref_b) * vp_local * 4
    ref_fwd = ref + ref_head_copy + max(forward_transient(cfg, lay.tp, tok, act_b) + cp_attn, ref_logits)
    # then the policy's no-grad old-log-prob pass beside that head copy: its fused head holds the policy's
    # [chunk, Vp/tp] fp32 logits, one temporary (+ the reference's logits with the exact KL), and with
    # rollout.record_hidden the exact KL(rollout || policy) head's policy and rollout logits and a temporary
    old_rows = batch.rollout_rows if batch.old_rows is None else batch.old_rows
    pol_logits = head_chunk(batch.kl_chunk, -(-old_rows * batch.response_len // lay.cp), vp_local, cfg.hidden_size,
                            act_b) * vp_local * 4 if old_rows else 0
    old_head = max(2 + exact_kl, 3 if batch.rollout_hidden else 0) * pol_logits
    old_fwd = ref + ref_head_copy + max(forward_transient(cfg, lay.tp, tok, act_b) + cp_attn, old_head)
    experience = parts["policy weights"] + parts["AdamW state"] + max(ref_fwd, old_fwd) + kept
    return {"parts": parts, "rollout_peak": rollout, "update_peak": update, "experience_peak": experience,
            "reference_forward_peak": ref_fwd, "old_forward_peak": old_fwd, "peak": max(rollout, update, experience),
            "offload_s_per_forward": offload_s}


def forward_transient(cfg: ModelConfig, tp: int, tokens: int, act_bytes: int) -> int:
    """Bytes alive inside one layer of a no-grad forward: the MLP's gate, up and product (3 I/tp)
    and three hidden-sized tensors (residual, normed input, output) per token."""
    return tokens * (3 * cfg.intermediate_size // tp + 3 * cfg.hidden_size) * act_bytes


def rollout_fields(ro) -> dict:
    """The Batch fields a rollout config (rl/config.py's RolloutConfig, duck-typed) sets: prompt tokens
    per prefill forward, the rows sharing one prefill (the group size with share_prefill), and whether
    the rollout's hidden states are kept."""
    return {"prefill_tokens": ro.prefill_tokens, "rows_per_prompt": ro.group_size if ro.share_prefill else 1,
            "rollout_hidden": bool(getattr(ro, "record_hidden", False))}


def rollout_work(cfg: ModelConfig, tp: int, batch: Batch, act_bytes: int, kv_cache: int) -> int:
    """Bytes the rollout allocates beside its KV cache (core/generation/generate.py): the larger of a prefill
    block's forward transients (rows_per_block x P tokens; `prefill_tokens` 0 runs every row at once;
    with a shared prefill only one row per prompt runs)
    and a decode position's logits [rows, Vp/tp] (float32: the rollout head computes the trainer's logits)
    with one float32 [rows, Vp/tp] sampler temporary and one for the recorded log-prob, plus one layer's K
    (or V) copy when compaction drops finished rows."""
    P = max(batch.seq_len - batch.response_len, 1)
    prompts = -(-batch.rollout_rows // max(batch.rows_per_prompt, 1))  # rows the prefill runs
    per = prompts if batch.prefill_tokens <= 0 else max(1, batch.prefill_tokens // P)
    prefill = forward_transient(cfg, tp, min(per, prompts) * P, act_bytes)
    vp_local = cfg.padded_vocab_size(tp) // tp
    # the logits (float32 from the rollout head in any compute dtype), the sampler's float32 temporary and
    # the recorded log-prob's one
    decode = batch.rollout_rows * vp_local * 12 + kv_cache // (2 * cfg.n_layers)
    return max(prefill, decode)


def projected_peak_bytes(cfg, world_size: int, device: str = "cuda", teacher: ModelConfig | None = None,
                         teacher_is_reference: bool = False, old_deferred: bool | None = None) -> dict:
    """The projected peak per rank of one RL step for an RLConfig-shaped `cfg` (sections model,
    parallel, rollout, algo, reference; duck-typed, so core does not import rl) on `world_size`
    ranks: step_budget's dict plus 'layout', 'batch' and 'device'. `device` ("cuda" or "cpu") labels the
    result and resolves parallel.mixed_precision "auto" (bf16 on CUDA only). `teacher`: a distillation
    teacher's shape (cfg.teacher says its placement and dtype; `add_teacher`); `teacher_is_reference`: no
    reference is loaded, the teacher stands in. `old_deferred`: whether the old-log-prob pass skips epoch 0's
    first mini-batch (rl/update/step_data.py's `defers_old_rows`; None: whenever algo.old_from_update is on and
    the KL is in the loss)."""
    par, ro, algo = cfg.parallel, cfg.rollout, cfg.algo
    tp = par.tp
    dp, cp = par.resolve_dp(world_size), getattr(par, "cp", 1)  # parallel.cp: context parallelism, when built
    if tp < 1 or dp < 1 or tp * dp * cp != world_size:
        raise ValueError(f"parallel.tp={tp} x cp={cp} x dp={dp} does not match world_size={world_size}")
    mp = par.precision(device) if hasattr(par, "precision") else par.mixed_precision
    lay = Layout(tp, dp, par.fsdp, "bf16" if mp == "bf16" else "fp32", par.activation_checkpointing,
                 getattr(par, "sequence_parallel", False), cp, getattr(par, "cp_impl", "ulysses"))
    rows = -(-ro.prompts_per_step * ro.group_size // dp)  # this dp rank's share of the step's samples
    per_mb = -(-rows // algo.mini_batches)
    update_rows = min(per_mb, algo.micro_batch_size) if algo.micro_batch_size else per_mb
    seq = cfg.model.max_seq_len
    data = getattr(cfg, "data", None)
    if data is not None and getattr(data, "max_prompt_tokens", None):  # rows never pass prompt + response
        seq = min(seq, data.max_prompt_tokens + ro.max_new_tokens)
    # the rollout keeps tp x dp: the cp ranks of a dp group each generate the group's rows (the same rows,
    # rl/update/context_heads.py), then each pass splits every sequence over cp
    batch = Batch(rows, update_rows, seq, ro.max_new_tokens, algo.kl_chunk_size, **rollout_fields(ro),
                  group_size=ro.group_size, shared_prompts=bool(getattr(algo, "share_prompts", False)))
    kl_cfg = getattr(cfg, "kl", None)
    if old_deferred is None:
        old_deferred = getattr(algo, "old_from_update", False) and getattr(kl_cfg, "where", None) == "loss"
    if old_deferred:
        batch.old_rows = rows - per_mb  # epoch 0's first mini-batch: its old log-probs come from the update
    placement = "cpu_offload" if cfg.reference.cpu_offload else ("tp_fsdp" if lay.fsdp_shards > 1 else "tp")
    rc = cfg.reference
    if getattr(rc, "from_policy_base", False):
        placement = "policy_base"
    ema = rc.sync_mode == "ema" and (rc.sync_every > 0 or rc.sync_below is not None)
    lora = getattr(cfg, "lora", None)
    lk = dict(lora_rank=lora.rank, lora_targets=tuple(lora.targets),
              lora_norms=getattr(lora, "train_norms", False)) if lora is not None and lora.rank else {}
    if teacher is not None and teacher_is_reference:
        placement = "policy_base"  # no reference is loaded: the teacher stands in for it (rl/distill/config.py)
    method = "fused_loss" if getattr(algo, "fused_loss", False) else "fused"
    exact = bool(getattr(getattr(cfg, "kl", None), "exact", False))
    out = step_budget(cfg.model, lay, batch, placement, method, "bf16" if rc.dtype == "bf16" else None, ema,
                      exact_kl=exact, **lk)
    if teacher is not None:
        tc = cfg.teacher
        t_place = "cpu_offload" if tc.cpu_offload else ("tp_fsdp" if lay.fsdp_shards > 1 else "tp")
        out = add_teacher(out, teacher, lay, batch, t_place, "bf16" if tc.dtype == "bf16" else None)
        placement = "the teacher" if teacher_is_reference else placement
    return {**out, "layout": lay, "batch": batch, "placement": placement, "device": device}


def add_teacher(out: dict, teacher: ModelConfig, lay: Layout, batch: Batch, placement: str,
                dtype: str | None = None) -> dict:
    """`step_budget`'s dict with a frozen distillation teacher (rl/distill/teacher.py; its own shape, sharded
    like the reference by `placement`): its weights resident in every phase; its no-grad pass in the experience
    phase (the copy of its head weight, one layer's transients or a [chunk, Vp/tp] fp32 logits tensor); its
    hidden states [rows, N, H_t] and head copy kept through the update, where the distillation term reads them."""
    t_b = DTYPE_BYTES[dtype or lay.compute_dtype]
    act_b = DTYPE_BYTES[lay.compute_dtype]
    weights, _ = reference_bytes(placement, teacher, lay, t_b)
    vp_local = teacher.padded_vocab_size(lay.tp) // lay.tp
    head_copy = vp_local * teacher.hidden_size * t_b
    hidden = batch.rollout_rows * batch.response_len * teacher.hidden_size * t_b
    logits = head_chunk(batch.kl_chunk, batch.update_rows * batch.response_len, vp_local, teacher.hidden_size, t_b)
    fwd = weights + head_copy + max(forward_transient(teacher, lay.tp, batch.update_tokens(), act_b),
                                    logits * vp_local * 4)
    parts = dict(out["parts"], **{"teacher": weights, "teacher hidden": hidden + head_copy})
    rollout = out["rollout_peak"] + weights
    resident = out["experience_peak"] - out["reference_forward_peak"]  # what the reference's pass runs beside
    experience = max(out["experience_peak"] + weights, resident + fwd + hidden)
    update = out["update_peak"] + weights + hidden + head_copy
    return dict(out, parts=parts, rollout_peak=rollout, experience_peak=experience, update_peak=update,
                teacher_forward_peak=fwd, peak=max(rollout, experience, update))
