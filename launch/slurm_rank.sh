#!/usr/bin/env bash
# One SLURM task = one rank. `launch.sh pretrain` starts this through srun (one task per GPU) with
# MASTER_ADDR, MASTER_PORT and WORLD_SIZE already exported; it maps SLURM's per-task numbering to
# the torch.distributed variables the toolkit's init_distributed reads, then becomes the command.
set -euo pipefail

for var in SLURM_PROCID SLURM_LOCALID SLURM_NTASKS MASTER_ADDR MASTER_PORT; do
    if [[ -z "${!var:-}" ]]; then
        echo "slurm_rank.sh: error: $var is unset; start this through './launch.sh pretrain' inside a SLURM allocation" >&2
        exit 2
    fi
done

export RANK=$SLURM_PROCID
export LOCAL_RANK=$SLURM_LOCALID
export WORLD_SIZE=$SLURM_NTASKS
export NODE_RANK=${SLURM_NODEID:-0}
# Tasks per node as SLURM counts them ("4(x2)" on homogeneous allocations -> 4).
tasks_per_node=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-}}
export LOCAL_WORLD_SIZE=${tasks_per_node%%(*}

exec "$@"
