#!/usr/bin/env bash
# kltron GPU check, a few minutes on 1-8 GPUs:  bash scripts/gpu_check.sh
#   1. layout equivalence under NCCL (fp32, TF32 off) for every tp x dp layout the GPU count allows
#      (1 GPU: tp=dp=1 vs the single-GPU reference, plus a bf16 SFT sanity run),
#   2. training throughput and MFU of a ~1B Llama (Llama-3.2-1B shape) in bf16 with FSDP2
#      (on 1 GPU FSDP is skipped, dp=1: bf16 autocast; measured anyway).
# Without a GPU it runs the CPU fallback of both (gloo, tiny model) so the path is checked.
# Exit status: number of failed sections (0 = all passed).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
OUT="${OUT:-/tmp/kltron_gpu_check}"
mkdir -p "$OUT"
NGPU=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
CPU=""
if [ "$NGPU" -eq 0 ]; then CPU="--cpu"; fi
failed=0
section() { echo; echo "=== $* ==="; }
run() {  # run a command with a timeout; count a failure
  local t=$1; shift
  echo "+ $*"
  if ! timeout "$t" "$@"; then echo "!!! FAILED (exit $?): $*"; failed=$((failed + 1)); fi
}

section "kltron gpu_check: $(python -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")') x${NGPU}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

section "1. layout equivalence (tests/test_layout.py checks; NCCL on GPU, gloo on CPU)"
run 240 python -m tests.gpu.layout_nccl $CPU --bf16-sanity
for n in 2 4 8; do
  if [ "$NGPU" -ge "$n" ]; then
    run 240 torchrun --standalone --nproc_per_node "$n" -m tests.gpu.layout_nccl
  fi
done

section "2. throughput and MFU, ~1B Llama, bf16, FSDP2 over all GPUs"
if [ "$NGPU" -ge 1 ]; then
  run 400 torchrun --standalone --nproc_per_node "$NGPU" bench/bench_mfu.py --seq 2048 --mb 4 --steps 10 \
    --json "$OUT/mfu.json"
else
  run 120 python bench/bench_mfu.py --cpu --json "$OUT/mfu.json"
fi
[ -f "$OUT/mfu.json" ] && cat "$OUT/mfu.json"

section "summary"
if [ "$failed" -eq 0 ]; then echo "gpu_check: ALL PASSED"; else echo "gpu_check: $failed section(s) FAILED"; fi
exit "$failed"
