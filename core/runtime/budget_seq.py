"""The budget's sequence-dependent terms under sequence parallelism (SP) and context parallelism (CP).

Per rank, with T = rows x S tokens of an update micro-batch and a layout tp x cp x dp (elements per
token; q = n_heads hd / tp, kv = max(n_kv_heads / tp, 1) hd):

| term (part)                          | without SP / CP               | SP (inside TP)      | CP                 |
|--------------------------------------|-------------------------------|---------------------|--------------------|
| tokens a rank holds                  | T                             | T                   | T / cp             |
| "sequence activations", per layer:   | 6 H                           | 6 H / tp            | on T / cp tokens   |
|   2 RMSNorms (input, fp32 normalised |                               |                     |                    |
|   copy: 4H), q/k/v's and gate/up's   |                               |                     |                    |
|   input (2H)                         |                               |                     |                    |
|   ... with LoRA (the layers' own     | 6 H                           | 4 H / tp + 2 H      |                    |
|   forward keeps the gathered input)  |                               |                     |                    |
| "sequence activations": checkpointed | L x H                         | L x H / tp          | on T / cp tokens   |
|   block inputs; the final RMSNorm    | + 2 H                         | + 2 H / tp          |                    |
| "activations": the rest, per layer   | 2 q + 4 kv + 4 I/tp           | the same            | on T / cp tokens   |
|   (q, k, v before and after RoPE;    |                               |                     |                    |
|   gate, up, silu(gate), product),    |                               |                     |                    |
|   + the RoPE tables 2 hd, once       |                               |                     |                    |
| "CP attention", one layer's buffers  | -                             | -                   | ulysses: 2 (q + 2  |
|                                      |                               |                     | kv); ring: 2 x 2kv |
| KL head                              | over the response tokens      | the same            | response / cp      |
| FSDP shard of weights, grads         | P_tp / dp                     | the same            | P_tp / (dp x cp)   |

With activation checkpointing one layer's set (sequence and other) is counted once, for the recompute.
The SP column is checked against MemTracker (tests/test_seq_parallel_memory.py, bench/bench_seq_parallel.py).
The CP column is arithmetic on the layout (parallel.cp, parallel.cp_impl) and assumes the rollout is not
context-parallel: each of a dp group's cp ranks generates 1/cp of its rows.
"""

from __future__ import annotations

CP_IMPLS = ("ulysses", "ring")


def seq_act(cfg, tp: int, sp: bool, lora: bool = False) -> int:
    """Elements per token per layer SP holds on 1/tp of the sequence: the two RMSNorms' input and fp32
    normalised copy (4H) and the column-parallel layers' input (2H: q/k/v's, gate/up's; parallel/layers.py's
    column_parallel keeps this rank's slice and gathers it again in backward). With LoRA adapters the layers
    run their own forward, which keeps the gathered input: 2H whole."""
    H = cfg.hidden_size
    if not sp:
        return 6 * H
    return 4 * H // tp + (2 * H if lora else 2 * H // tp)


def other_act(cfg, tp: int) -> int:
    """Elements per token per layer saved beside `seq_act`: q, k, v before and after RoPE (2q + 4kv) and the
    MLP's gate, up, silu(gate) and their product (4 I/tp)."""
    hd = cfg.head_dim
    q, kv = cfg.n_heads * hd // tp, max(cfg.n_kv_heads // tp, 1) * hd
    return 2 * q + 4 * kv + 4 * cfg.intermediate_size // tp


def activation_parts(cfg, lay, tokens: int, act_bytes: int, lora: bool = False) -> tuple[int, int]:
    """(activations SP does not touch, sequence activations SP divides by tp) in bytes for `tokens` tokens
    on this rank (already / cp). With activation checkpointing: every block's input (the residual stream, H
    per token and layer, 1/tp under SP) plus one layer's full set, for its recompute in backward."""
    sp = lay.sp and lay.tp > 1
    div = lay.tp if sp else 1
    final = 2 * cfg.hidden_size // div  # the final RMSNorm's input and normalised copy
    rope = 2 * cfg.head_dim  # cos and sin, one table for every layer (the whole sequence: attention's)
    layers = 1 if lay.activation_checkpointing else cfg.n_layers
    seq = layers * seq_act(cfg, lay.tp, sp, lora) + final
    if lay.activation_checkpointing:
        seq += cfg.n_layers * cfg.hidden_size // div
    return (layers * other_act(cfg, lay.tp) + rope) * tokens * act_bytes, seq * tokens * act_bytes


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
