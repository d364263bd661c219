#!/usr/bin/env bash
# One SLURM task = one rank. `launch.sh pretrain` starts this through srun (one task per GPU) with
# MASTER_ADDR, MASTER_PORT and WORLD_SIZE already exported; it maps SLURM's per-task numbering to
# the torch.distributed variables the toolkit's init_distributed reads, then becomes the command.
# The mapping is slurm_task_env in pretrain/distributed/cluster.py (init_distributed uses it too, for tasks started
# without this wrapper): RANK, WORLD_SIZE, NODE_RANK, LOCAL_WORLD_SIZE, and LOCAL_RANK as the device
# index, which is 0 where the task sees one GPU only (--gpus-per-task=1, --gpu-bind=single:1).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Not the working folder first on the import path (`python -m` puts it there): a module planted in a shared working
# folder must not run as you. launch.sh exports it already; a task started without launch.sh gets it here.
export PYTHONSAFEPATH=1
# The rank's own interpreter reads it (launch.sh passes $PYTHON first); python3 if the command is not Python.
python=${1:-python3}
[[ "${python##*/}" == python* ]] || python=python3
exports=$(PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pretrain.distributed.cluster --prog slurm_rank.sh \
    slurm-task) || exit $?
eval "$exports" # export NAME='value' lines, quoted by shlex.quote

exec "$@"
