"""The budget's sequence-dependent terms under sequence parallelism (SP) and context parallelism (CP).

Per rank, with T = rows x S tokens of an update micro-batch and a layout tp x cp x dp:

| term                         | without SP / CP              | SP (inside TP)           | CP                        |
|------------------------------|------------------------------|--------------------------|---------------------------|
| tokens a rank holds          | T                            | T                        | T / cp                    |
| norm activations, per layer  | 4 H  (2 RMSNorms: input and  | 4 H / tp                 | on T / cp tokens          |
|                              | fp32 normalised copy)        |                          |                           |
| other saved, per layer       | 2 H (the gathered inputs of  | the same (autograd saves | on T / cp tokens          |
|                              | q/k/v and gate/up) + 2 q +   | the gathered tensor)     |                           |
|                              | 4 kv + 4 I/tp                |                          |                           |
| checkpointed block inputs    | L x H                        | L x H / tp               | on T / cp tokens          |
| the final RMSNorm            | 2 H                          | 2 H / tp                 | on T / cp tokens          |
| RoPE tables (cos, sin)       | 2 hd, once                   | the same                 | on T / cp tokens          |
| attention's CP buffers       | -                            | -                        | ulysses: 2 (q + 2 kv) of  |
|                              |                              |                          | T / cp (all-to-all in and |
|                              |                              |                          | out); ring: 2 x 2 kv of   |
|                              |                              |                          | T / cp (chunk in use, next)|
| KL head                      | over the response tokens     | the same (the head gets  | over response tokens / cp |
|                              |                              | every token)             |                           |
| FSDP shard of weights, grads | P_tp / dp                    | the same                 | P_tp / (dp x cp)          |

q = n_heads hd / tp and kv = max(n_kv_heads / tp, 1) hd. The SP column is checked against MemTracker
(tests/test_seq_parallel_memory.py: the norm activations measured at 1/tp, the budget within 10%). The
CP column is arithmetic on the layout (parallel.cp, parallel.cp_impl) and assumes the rollout is not
context-parallel: each of a dp group's cp ranks generates 1/cp of its rows.
"""

from __future__ import annotations

CP_IMPLS = ("ulysses", "ring")


def norm_act(cfg, tp: int, sp: bool) -> int:
    """Elements per token per layer saved by the two RMSNorms (input and fp32 normalised copy, 2H each);
    SP holds them on this rank's 1/tp of the sequence."""
    return 4 * cfg.hidden_size // (tp if sp else 1)


def other_act(cfg, tp: int) -> int:
    """Elements per token per layer saved outside the norms: the projections' gathered inputs (2H), q, k, v
    before and after RoPE (2q + 4kv) and the MLP's gate, up, silu(gate) and product (4 I/tp)."""
    hd = cfg.head_dim
    q, kv = cfg.n_heads * hd // tp, max(cfg.n_kv_heads // tp, 1) * hd
    return 2 * cfg.hidden_size + 2 * q + 4 * kv + 4 * cfg.intermediate_size // tp


def activation_parts(cfg, lay, tokens: int, act_bytes: int) -> tuple[int, int]:
    """(activations SP does not touch, norm / residual activations SP divides by tp) in bytes for `tokens`
    tokens on this rank (already / cp). With activation checkpointing: every block's input (the residual
    stream, H per token and layer, 1/tp under SP) plus one layer's full set."""
    sp = lay.sp and lay.tp > 1
    div = lay.tp if sp else 1
    final = 2 * cfg.hidden_size // div  # the final RMSNorm's input and normalised copy
    rope = 2 * cfg.head_dim  # cos and sin, one table for every layer (the whole sequence: attention's)
    if lay.activation_checkpointing:
        seq = (cfg.n_layers * cfg.hidden_size // div + norm_act(cfg, lay.tp, sp) + final) * tokens * act_bytes
        return (other_act(cfg, lay.tp) + rope) * tokens * act_bytes, seq
    return ((cfg.n_layers * other_act(cfg, lay.tp) + rope) * tokens * act_bytes,
            (cfg.n_layers * norm_act(cfg, lay.tp, sp) + final) * tokens * act_bytes)


def cp_attention_bytes(cfg, lay, tokens: int, act_bytes: int) -> int:
    """One layer's context-parallel attention buffers on `tokens` (= T / cp) tokens: Ulysses's all-to-all
    input and output of q, k, v; ring attention's two K/V chunks (the one in use and the one arriving)."""
    if lay.cp <= 1:
        return 0
    hd = cfg.head_dim
    q, kv = cfg.n_heads * hd // lay.tp, max(cfg.n_kv_heads // lay.tp, 1) * hd
    if lay.cp_impl == "ring":
        return 2 * 2 * kv * tokens * act_bytes
    if lay.cp_impl == "ulysses":
        return 2 * (q + 2 * kv) * tokens * act_bytes
    raise ValueError(f"parallel.cp_impl {lay.cp_impl!r}: choose from {CP_IMPLS}")
