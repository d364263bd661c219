#!/usr/bin/env bash
# One prepared GPU check (issues 8, 12, 20): the production training step of the shipped recipe
# (PhaseTrainer.train_step, A micro-batches per optimizer step, the real DataLoader over synthetic
# shards with real-data padding, bf16 + ZeRO-1 + fp32 grad accumulation = BF16_Optimizer around our
# ExactLamb) at the recipe's micro-batches, packed phase 2, the throughput timer on vs off, peak
# memory, the LAMB step against its memory floor, and an ESTIMATE of each shipped recipe's phase
# wall-clock on 8 / 64 / 256 GPUs from those one-GPU rows (docs/performance.md).
#
#   bench/gpu_check/gpu_check.sh [--smoke] [--jsonl OUT.jsonl] [--rows p1,p2,...] [any bench/gpu_check/run.py flag]
#   bench/gpu_check/gpu_check.sh --jsonl first_check.jsonl   # the first check on a new GPU: this, once, as it is
#   bench/gpu_check/gpu_check.sh --rows selftest     # the kernel self-test's verdict table alone (~1 min); the full
#                                                     # check prints the same table first, so not needed before it
#
# Runs on a bare machine with PyTorch and no network: it installs nothing. The preflight
# (bench/gpu_check/preflight.py) imports what the check imports and prints every wheel that loaded
# (those beyond torch's own are the ones to carry in); a missing one is named in one line, exit 2.
# Each row is appended to OUT.jsonl (default ./gpu_check.jsonl) and printed the moment it is
# measured, so a crash or the time limit keeps what was measured.
#
# Budget: a hard limit of 9.5 minutes on one H100 or H200, preflight included (SIGTERM at the limit saves
# the estimate from the rows so far and exits 124; SIGKILL 20 s later); rows that would start with
# under 45 s left are skipped. Each part has its own budget besides (bench/gpu_check/budget.py, --part-budget):
# a part that overruns is stopped (SIGALRM), its rows saved as "stopped" with the reason, and the next part runs.
# Estimated (not yet measured; BERT-Large at micro 64 x 128 is ~45 ms a micro-batch on an H100, est., 1 + 2
# warm-up + 3 timed steps of 32 micro-batches per row), with each part's budget:
#   preflight imports; check start-up (imports again, NCCL world of one)          ~ 30-50 s
#   selftest: the kernel self-test in bf16 (the recipes' precision; fp16 skipped,
#     --selftest-precisions bf16,fp16 runs it) x head 64 x seq 128 and 512, each
#     in a child process (~5-10 s), and the compiled layer's check at seq 512 in
#     one more child with one inductor compile of the run's layer (~20-40 s)      ~ 40-75 s   budget 120 s
#   p1: p1, p1-padded, p1-full, p1-opt: BERT-Large 128 x 64, one engine (~10-15 s
#     to build; the first step compiles the layer and the fused LAMB, ~20-60 s),
#     synthetic shards (~5-10 s)                                                  ~ 70-120 s  budget 120 s
#   p2: p2, p2-padded, p2-packed, p2-opt: 512 x 16, one engine                   ~ 45-60 s   budget  75 s
#   lamb: LAMB over BERT-Large (335M fp32): copy bandwidth, reference, fused step ~ 10-60 s   budget  60 s
#   bert_base:p1, bert_base:p2 (bert_base.json, 128 / 32): one engine each        ~ 35-50 s   budget 30+30 s
#   total                                                                         ~ 4-7 min (budgets: 8.1 min)
#   with --comparisons (rows no recipe runs): p1-timer-on, p1-big (128 x 256),
#     p2-big (512 x 64), one engine each, before BERT-base                        ~ 60-80 s   budget 30+35+35 s
# On a first run a part may be stopped, or the last rows (BERT-base) skipped: by design; the file says which.
# --smoke runs every row on CPU with the tiny model at tiny shapes (the same engine and trainer,
# one timed step per row), about a minute on 2 idle cores; no part budgets unless --part-budget names some.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$(dirname "$here")")"
python="${PYTHON:-python3}"  # the interpreter that has the (CUDA) PyTorch; PYTHON=... to choose another

smoke=0
for arg in "$@"; do [[ "$arg" == "--smoke" ]] && smoke=1; done
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
# TorchInductor imports the modules and unpickles the graphs it finds in its cache folder, so the folder must be
# this user's alone: TORCHINDUCTOR_CACHE_DIR when given (made 0700 when absent; refused in one line, exit 2,
# when it is a link, another user's, or writable by group or others), else torch's own per-user default,
# $TMPDIR/torchinductor_$USER (made 0700; when someone else made it first, a fresh `mktemp -d` folder instead).
private_folder() {  # prints why "$1" is no folder of this user's alone; nothing when it is
  if [[ -L "$1" || ! -d "$1" ]]; then echo "is not a folder (a link or a file)"; return; fi
  local owner mode
  read -r owner mode < <(stat -c '%u %a' -- "$1")
  if [[ $owner != "$(id -u)" ]]; then echo "belongs to uid $owner, not to you (uid $(id -u))";
  elif (( (8#$mode & 8#022) != 0 )); then echo "is writable by group or others (mode $mode)"; fi
}
if [[ -n "${TORCHINDUCTOR_CACHE_DIR:-}" ]]; then
  cache="$(realpath -m -- "$(dirname -- "$TORCHINDUCTOR_CACHE_DIR")")/$(basename -- "$TORCHINDUCTOR_CACHE_DIR")"
  if [[ ! -e "$cache" && ! -L "$cache" ]]; then
    mkdir -p -- "$(dirname -- "$cache")" && mkdir -m 700 -- "$cache" 2>/dev/null || true
  fi
  unsafe="$(private_folder "$cache")"
  if [[ -n "$unsafe" ]]; then
    echo "gpu_check: TORCHINDUCTOR_CACHE_DIR=$cache $unsafe: inductor would run code others can plant there;" \
      "use a folder only you can write (unset it for a private one)" >&2
    exit 2
  fi
else
  cache="${TMPDIR:-/tmp}/torchinductor_$(id -un 2>/dev/null || id -u)"
  mkdir -m 700 -- "$cache" 2>/dev/null || true
  unsafe="$(private_folder "$cache")"
  if [[ -n "$unsafe" ]]; then
    fresh="$(mktemp -d "${TMPDIR:-/tmp}/torchinductor_gpu_check.XXXXXXXX")"
    echo "gpu_check: $cache $unsafe: compiling into a fresh private folder $fresh instead" >&2
    cache="$fresh"
  fi
fi
export TORCHINDUCTOR_CACHE_DIR="$cache"
if [[ $smoke == 1 ]]; then
  export DS_ACCELERATOR=cpu
  limit=300
else
  limit=570  # 9.5 minutes, preflight included: the check and its SIGKILL margin end within 10 minutes
fi

"$python" "$here/preflight.py" "$@"  # exit 2 (set -e) when a wheel is missing, before any work
if [[ $smoke == 0 ]]; then
  command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,compute_mode --format=csv || true
fi
left=$((limit - SECONDS))
budget=()
[[ $smoke == 0 ]] && budget=(--deadline "$(($(date +%s) + left - 20))")
# SIGTERM at the limit (the check saves an "end" record and exits 124), SIGKILL 20 s later if stuck in a kernel.
exec timeout --signal=TERM --kill-after=20 "$left" "$python" -m bench.gpu_check ${budget[@]+"${budget[@]}"} "$@"
