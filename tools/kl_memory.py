"""What the policy-vs-reference KL term costs: peak memory, time and communication of the ways to
get target log-probs, entropy and the KL (or an estimate) from hidden states and (sharded) LM-head
weights; measured here or projected to real model sizes without allocating.

    python -m tools.kl_memory --tokens T --hidden H --vocab V [--tp N] [--dtype fp32|bf16|fp16]
        (--json OUT.json | --report DIR) [--methods ...] [--peers verl_k3,trl_k3,cce_k3,liger_jsd]
        [--model llama3-8b|qwen2.5-7b|llama3-70b|qwen2.5-0.5b] [--sweep tokens=8k,32k,tp=1,2,4]
        [--project] [--device cpu|cuda] [--warmup 1] [--repeats 3] [--chunk-size C]
        [--pass forward|forward+backward|both] [--cpu-peak memtracker|profiler] [--timeout S] [--force]
        [--seed S]

The code lives in tools/klcost/: methods.py (the paths and the matmul floor), peers.py (verl, TRL,
Cut Cross-Entropy, Liger), measure.py (measured rows), spawn.py (tp > 1 on gloo ranks, every wait
bounded), project.py (FakeTensorMode projections, the size guard), report.py (table, plots),
cli.py (arguments), cpu_peak.py (the CPU allocator's peak from torch.profiler's events). The
whole RL step's budget is core/runtime/budget.py.

Row fields: name, method, mode (exact, k3, jsd, -), pass, source (measured | projected), tokens,
hidden, vocab, tp, dtype, device, chunk_size, peak_bytes, memory_source (memtracker | profiler |
cuda_allocator: how peak_bytes was read), first_run_s (the first warm-up run, a compile included),
time_s (median), time_min_s, repeats, warmup, time_vs_floor, comm_bytes, comm_calls, logprob_mean,
entropy_mean, kl_mean. Measured rows at tp > 1 report the largest peak and time over the ranks and
rank 0's communication.
"""

from tools.klcost.cli import main

if __name__ == "__main__":
    main()
