#!/usr/bin/env bash
# kltron GPU check, under 8 minutes on one H200 (more GPUs: more layouts):
#   bash scripts/gpu_check.sh            # on a GPU machine (falls back to --cpu without one)
#   bash scripts/gpu_check.sh --cpu      # a tiny version of every section on the CPU (~30 s)
# Installs nothing: it needs the README's set-up only (torch, the repo's requirements).
# Sections (tests/gpu/gpu_check.py): layout equivalence and HF parity under NCCL; tokens/s and MFU of a
# ~1B Llama in bf16 with and without torch.compile; the default GRPO job and a ~0.5B GRPO config with
# step time and peak memory per phase; the fused exact-KL head vs gathering logits at T=32768, H=4096,
# V=128256 bf16; the bf16 KL error audit; tools.kl_memory at an 8B head; the sampler; the shared layout's plans
# against padding at long responses (bench.bench_layout_cost); context parallelism at cp=2: exactness under NCCL
# (gloo on the CPU with fewer than 2 GPUs) and the update at T=32768 per rank against cp=1 (tests/gpu/cp_check.py);
# the batch-invariant mode in fp32 and bf16: rollout and trainer log-probs bit-equal, KL(rollout || train) exactly 0,
# the bf16 mismatch without it, its time (tests/gpu/invariant_check.py).
# Everything goes to $OUT/gpu_check.json (OUT defaults to
# /tmp/kltron_gpu_check), logs to $OUT/logs/, and a table is printed.
# Exit status: the number of sections that did not pass (0 = all passed).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/kltron_gpu_check}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec python -m tests.gpu.gpu_check --out "$OUT" "$@"
