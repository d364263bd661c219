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
# LOCAL_RANK is the device index DeepSpeed binds. Sites that bind one GPU per task (--gpus-per-task=1,
# --gpu-bind=single:1) show each task only its own GPU, as index 0, whatever its SLURM_LOCALID.
IFS=, read -r -a visible <<<"${CUDA_VISIBLE_DEVICES:-}"
if ((${#visible[@]} == 1)) && [[ -n "${visible[0]// /}" ]]; then
    export LOCAL_RANK=0
fi
export WORLD_SIZE=$SLURM_NTASKS
export NODE_RANK=${SLURM_NODEID:-0}
# Tasks per node as SLURM counts them ("4(x2)" on homogeneous allocations -> 4).
tasks_per_node=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-}}
export LOCAL_WORLD_SIZE=${tasks_per_node%%(*}

exec "$@"
