#!/usr/bin/env bash
# One prepared GPU check (issue 8, issue 12): throughput / MFU of BERT-Large and BERT-base at phase-1
# and phase-2 shapes through the engine users run (bf16 + ZeRO-1 + fp32 grad accumulation =
# BF16_Optimizer around our ExactLamb), the LAMB step against its memory floor, peak memory.
#
#   bench/gpu_check.sh [--smoke] [--jsonl OUT.jsonl] [any bench/gpu_check.py flag]
#
# Runs on a bare machine with PyTorch and no network: it installs nothing. The preflight
# (bench/gpu_check_preflight.py) imports what the check imports and prints every wheel that loaded
# (those beyond torch's own are the ones to carry in); a missing one is named in one line, exit 2.
# Each row is appended to OUT.jsonl (default ./gpu_check.jsonl) and printed the moment it is
# measured, so a crash or the time limit keeps what was measured.
#
# Budget: everything below stops within 8 minutes on one H200 (a SIGTERM at the limit keeps the
# rows; training rows are skipped once less than 2 minutes are left so the LAMB rows still run).
# Estimated on one H200 (not yet measured; figures in parentheses are the expected step times):
#   preflight imports (torch, deepspeed, transformers)                           ~ 15-30 s
#   check start-up (imports again, NCCL world of one)                            ~ 15-20 s
#   BERT-Large seq 128 x256 (~0.16 s/step), 512 x64 (~0.17 s), packed 512 x64:
#     per row ~5 s model init + engine, 25 steps ~5 s; the first step of the
#     process compiles the fused LAMB kernels (~20-60 s)                         ~ 60-110 s
#   BERT-base, the same three rows                                               ~ 25-40 s
#   LAMB over BERT-Large (335M fp32): copy bandwidth, reference, fused step
#     (compiled kernels reused from the training rows; cold compile ~20-60 s)    ~ 15-75 s
#   total                                                                        ~ 2.5-4.5 min
# --smoke runs on CPU with tiny shapes (the same bf16 engine) in well under a minute (~15 s).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python="${PYTHON:-python3}"  # the interpreter that has the (CUDA) PyTorch; PYTHON=... to choose another

smoke=0
for arg in "$@"; do [[ "$arg" == "--smoke" ]] && smoke=1; done
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_gpu_check}"
if [[ $smoke == 1 ]]; then
  export DS_ACCELERATOR=cpu
  limit=120
else
  limit=480  # the 8-minute budget of one prepared check, preflight included
fi

"$python" "$here/gpu_check_preflight.py" "$@"  # exit 2 (set -e) when a wheel is missing, before any work
if [[ $smoke == 0 ]]; then
  command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv || true
fi
left=$((limit - SECONDS))
budget=()
[[ $smoke == 0 ]] && budget=(--deadline "$(($(date +%s) + left - 20))")
# SIGTERM at the limit (the check saves an "end" record and exits 124), SIGKILL 20 s later if stuck in a kernel.
exec timeout --signal=TERM --kill-after=20 "$left" "$python" "$here/gpu_check.py" ${budget[@]+"${budget[@]}"} "$@"
