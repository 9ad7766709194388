"""Benchmarks, each run from the repository root as a module: `python -m bench.bench_rl_step`,
`torchrun --nproc_per_node N -m bench.bench_mfu`, ... (see each file's docstring)."""
