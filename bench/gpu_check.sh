#!/usr/bin/env bash
# One prepared GPU check (issue 8): throughput / MFU of BERT-base and BERT-Large at phase-1 and
# phase-2 shapes, the LAMB step against its memory floor, peak memory. Prints markdown tables.
#
#   bench/gpu_check.sh [--smoke] [any bench/gpu_check.py flag]     # e.g. --json /tmp/gpu_check.json
#
# Runs on a bare machine with PyTorch and no network: it installs nothing. Besides PyTorch (CUDA
# build, which ships Triton) it needs these wheels, carried in: deepspeed, transformers, tokenizers,
# safetensors, huggingface_hub, numpy, pyarrow, packaging, psutil, py-cpuinfo, pydantic, hjson,
# msgpack, ninja, tqdm, regex, pyyaml, filelock (all in this repo's .venv / pyproject.toml).
# Budget: under 8 minutes on one H200; --smoke runs on CPU with tiny shapes in well under a minute.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python="${PYTHON:-python3}"  # the interpreter that has the (CUDA) PyTorch; PYTHON=... to choose another

missing=$("$python" - <<'PY'
import importlib.util
need = ["torch", "deepspeed", "transformers", "tokenizers", "safetensors", "numpy", "pyarrow"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [[ -n "$missing" ]]; then
  echo "gpu_check: missing Python packages: $missing" >&2
  echo "gpu_check: this script installs nothing; carry the wheels in and 'pip install --no-index --find-links DIR ...'" >&2
  exit 2
fi

smoke=0
for arg in "$@"; do [[ "$arg" == "--smoke" ]] && smoke=1; done
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_gpu_check}"
if [[ $smoke == 1 ]]; then
  export DS_ACCELERATOR=cpu
  limit=120
else
  limit=480  # the 8-minute budget of one prepared check
  "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv || true
fi
cd "$repo"
exec timeout --signal=TERM "$limit" "$python" bench/gpu_check.py "$@"
