#!/usr/bin/env bash
# launch.sh: the one entry point of the toolkit, from a 2-core laptop to a SLURM cluster.
#
#   ./launch.sh [--dry-run] SUBCOMMAND [options]      (./launch.sh --help for the list)
#
# Every subcommand prints the exact command it runs, prefixed with "+ " and shell-quoted so it
# can be copied; --dry-run prints it and runs nothing. Nothing here is site-specific: the
# interpreter is $PYTHON (see default_python), and cluster knobs come from the environment
# (NCCL_*, OMP_NUM_THREADS), which launch.sh only fills in when they are unset.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DRY_RUN=0
# The interpreter: $PYTHON; else the active virtual environment's; else the checkout's .venv (the
# README's install creates it, and a new shell may not have it activated); else python3 on PATH.
default_python() {
    if [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
        echo "$VIRTUAL_ENV/bin/python"
    elif [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then
        echo "$REPO_ROOT/.venv/bin/python"
    else
        command -v python3 || command -v python || echo python3
    fi
}
PYTHON="${PYTHON:-$(default_python)}"

# ----------------------------------------------------------------------------- helpers
die() {
    echo "launch.sh: error: $*" >&2
    exit 2
}

# Print a command as one copy-pastable line.
show() {
    local line="+" word
    for word in "$@"; do line+=" $(printf '%q' "$word")"; done
    echo "$line"
}

run() {
    show "$@"
    if ((DRY_RUN)); then return 0; fi
    if ((FORWARD_SIGNALS)); then
        run_forwarding_signals "$@"
    else
        "$@"
    fi
}

# ----------------------------------------------------------------------------- signals
# A supervisor stops a job by signalling launch.sh or its process group: SIGTERM (a scheduler, a
# container runtime), SIGUSR1 (SLURM before the time limit), SIGINT (Ctrl-C). The ranks must get it,
# checkpoint and exit, and launch.sh must wait for them and exit with their status. So the launcher
# runs in a process group of its own (a signal to ours reaches launch.sh only) and launch.sh delivers
# each signal itself: with the local DeepSpeed launcher straight to the ranks, its grandchildren
# (that launcher would SIGKILL them 30 s after forwarding, dies of SIGUSR1 and exits 1 whatever the
# ranks did); otherwise to the child: the one plain rank, srun (forwards to its tasks), or the pdsh
# runner (handles TERM and INT only, so SIGUSR1 reaches it as SIGTERM).
FORWARD_SIGNALS=0 CHILD_PID="" PENDING_SIGNAL=""

child_pids() { # $1 = a pid: its children's pids, one a line (read from /proc: no procps needed)
    local stat line fields
    for stat in /proc/[0-9]*/stat; do
        { read -r line <"$stat"; } 2>/dev/null || continue
        fields=(${line##*) }) # after "pid (command name)": state, ppid, ...
        if [[ "${fields[1]:-}" == "$1" ]]; then echo "${line%% *}"; fi
    done
    return 0
}

signal_targets() { # the pids a forwarded signal goes to; none while the local ranks are starting
    local launcher
    if [[ "$LAUNCHER" == local ]]; then
        for launcher in $(child_pids "$CHILD_PID"); do child_pids "$launcher"; done
    else
        echo "$CHILD_PID"
    fi
    return 0
}

deliver_pending() {
    local signal=$PENDING_SIGNAL targets
    [[ "$LAUNCHER" != hostfile || "$signal" != USR1 ]] || signal=TERM
    targets=$(signal_targets)
    [[ -n "$targets" ]] || return 0 # retried while waiting
    echo "launch.sh: forwarding SIG$signal to" $targets >&2
    kill -s "$signal" $targets 2>/dev/null || true
    PENDING_SIGNAL=""
}

on_signal() {
    PENDING_SIGNAL=$1
    deliver_pending
}

# Run "$@" in the background, in its own process group, and return its exit status once it is gone;
# signals that reach launch.sh meanwhile are delivered as described above.
run_forwarding_signals() {
    local status=0
    trap 'on_signal TERM' TERM
    trap 'on_signal INT' INT
    trap 'on_signal USR1' USR1
    # Job control: the child leads a new process group and keeps SIGINT (not ignored). Its stdin is
    # /dev/null: a background group reading the terminal (srun, ssh under pdsh) would be stopped.
    set -m
    "$@" </dev/null &
    CHILD_PID=$!
    set +m
    while :; do
        if [[ -n "$PENDING_SIGNAL" ]] && kill -0 "$CHILD_PID" 2>/dev/null; then
            sleep 0.2 # the ranks are not started yet: deliver as soon as they are
            deliver_pending
            continue
        fi
        status=0
        wait "$CHILD_PID" || status=$?
        # wait also returns when a trapped signal arrives; the child is gone only when kill -0 fails.
        kill -0 "$CHILD_PID" 2>/dev/null || break
    done
    trap - TERM INT USR1
    return "$status"
}

# An input that an earlier step produces may be missing in a --dry-run of a pipeline: warn there.
require_path() { # $1 = test flag (-f/-d/-e), $2 = path, $3 = message
    if test "$1" "$2"; then return 0; fi
    ((DRY_RUN)) || die "$3"
    echo "launch.sh: note: $3 (continuing: --dry-run)" >&2
}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

need_value() { # $1 = option, $2 = number of remaining args (including the option)
    (($2 >= 2)) || die "$1 needs a value"
}

# ----------------------------------------------------------------------------- usage
usage() {
    cat <<'EOF'
Usage: ./launch.sh [--dry-run] SUBCOMMAND [options]

Subcommands
  prep  ARGS...                    python -m data_prep build ARGS   (data_prep's flags, e.g.
                                   --wiki-dump F --books DIR --vocab-size N --seq-lens 128,512 --out DIR)
  prep  merge --out DIR            python -m data_prep merge (after a multi-node build)
  prep  inspect OUT                python -m data_prep inspect OUT
  pretrain --config RUN.json [LAUNCH OPTIONS] [--section.key=value ...]
                                   both pretraining phases on every rank (see LAUNCH OPTIONS)
  squad finetune [LAUNCH OPTIONS] --model DIR --train F --dev F --out DIR [...]
  squad evaluate DATA.json PREDICTIONS.json [...]
  export CHECKPOINT OUT            python -m pretrain.export CHECKPOINT OUT
  tensorboard RUN_DIR [ARGS...]    TensorBoard on RUN_DIR
  scale RUN.json --phase1-batch N --phase2-batch M [--gpus G] --out NEW.json   the recipe at your batch
  demo [--sample-data DIR] [--out DIR] [...]
                                   the whole pipeline at toy scale on 2 CPU ranks (python -m pretrain.demo --help)

Global options
  --dry-run        print the commands, run nothing
  -h, --help       this help (after prep or demo: that module's own flags)

LAUNCH OPTIONS (pretrain, squad finetune). Where the ranks run is chosen in this order:
  --hostfile F     several nodes through the DeepSpeed launcher (pdsh/ssh; lines "host slots=N";
                   the checkout must be at the same path on every node)
  SLURM            inside an allocation (SLURM_JOB_ID set): one srun task per GPU, RANK/WORLD_SIZE/
                   LOCAL_RANK from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, MASTER_ADDR = first node
  local            otherwise: the GPUs of this machine through the DeepSpeed launcher
  --launcher local|hostfile|slurm|none   force one (default: auto, as above); none = one plain
                   process without a launcher (single rank, e.g. a small SQuAD fine-tune on CPU)
  --gpus N         ranks per node (default: SLURM's GPUs per node, else nvidia-smi's count)
  --nodes N        use only the first N nodes of the hostfile / allocation
  --master-addr A  rendezvous host (default: 127.0.0.1 / first hostfile host / first SLURM node)
  --master-port P  rendezvous port (default: 29500; under SLURM 20000 + job id % 20000)
  --cpu            CPU ranks over gloo (DS_ACCELERATOR=cpu) instead of GPUs; needs --gpus N
  --               pass everything after it to the Python module unchanged
  SIGTERM/SIGUSR1/SIGINT to launch.sh (or its process group) go on to the ranks; launch.sh waits and
  exits with their status (0 after a SIGTERM/SIGUSR1 checkpoint; rerun the same command to resume)

Environment defaults (only set when unset; documented in docs/launching.md, "Environment defaults")
  OMP_NUM_THREADS=cores/ranks-per-node (SLURM: cpus-per-task, also passed to srun)
  TOKENIZERS_PARALLELISM=false  NCCL_DEBUG=WARN
  PYTHONUNBUFFERED=1  PYTHONPATH=<repo>:$PYTHONPATH
  PYTHON = the interpreter (default: the active venv's, else <repo>/.venv's, else python3 on PATH)

Examples
  ./launch.sh demo --sample-data ../shared/data
  ./launch.sh pretrain --config ds_configs/recipes/bert_large_64k.json --gpus 8
  ./launch.sh pretrain --config RUN.json --hostfile hosts.txt --dry-run
  sbatch launch/slurm_pretrain.sbatch ds_configs/recipes/bert_large_64k.json
  codistillation as two separate allocations that meet in a shared folder (docs/codistillation.md):
  sbatch launch/slurm_pretrain.sbatch ds_configs/recipes/bert_large_codistill.json --codistill.group=0 \
      --codistill.exchange=filesystem --codistill.exchange_dir=/shared/exchange     (and group=1)
EOF
}

# ----------------------------------------------------------------------------- environment
cpu_count() {
    nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1
}

# The variables launch.sh sets for every rank, as NAME=VALUE lines; $1 = ranks per node, $2 = CPUs
# per rank when the scheduler granted a number (SLURM's cpus-per-task).
# OMP threads: an unset OMP_NUM_THREADS lets every rank spawn one thread per core, so 8 ranks on
# a 64-core node run 512 threads; splitting the cores evenly is the safe default.
rank_env_lines() {
    local ranks_per_node=$1 threads=${2:-}
    if [[ -z "$threads" ]]; then
        threads=$(($(cpu_count) / (ranks_per_node > 0 ? ranks_per_node : 1)))
        ((threads >= 1)) || threads=1
    fi
    echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}"
    # The fast tokenizers' thread pool deadlocks after fork (DataLoader workers); keep it off.
    echo "TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}"
    # WARN surfaces NCCL's own diagnosis of a hang (wrong interface, IB down) without flooding logs;
    # set NCCL_DEBUG=INFO to see the topology. NCCL_SOCKET_IFNAME etc. are passed through untouched.
    echo "NCCL_DEBUG=${NCCL_DEBUG:-WARN}"
    echo "PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-1}"
    echo "PYTHONPATH=$(with_repo_on_path)"
}

# $PYTHONPATH with the checkout in front (once), so `-m pretrain.train` resolves without an install.
with_repo_on_path() {
    case ":${PYTHONPATH:-}:" in
        *":$REPO_ROOT:"*) echo "$PYTHONPATH" ;;
        *) echo "${REPO_ROOT}${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
}

export_rank_env() { # $1 = ranks per node, $2 = CPUs per rank (optional)
    local line assignments=()
    while IFS= read -r line; do
        export "${line?}"
        assignments+=("$line")
    done < <(rank_env_lines "$1" "${2:-}")
    if ((CPU_MODE)); then
        export DS_ACCELERATOR=cpu
        assignments+=("DS_ACCELERATOR=cpu")
    fi
    show export "${assignments[@]}"
}

# ----------------------------------------------------------------------------- cluster discovery
# What the cluster says (SLURM's node list and GPUs, the hostfile, this machine's GPUs, the rendezvous
# host and port, the pdsh quoting) is read by pretrain/cluster.py, which engine.py and slurm_rank.sh
# share. One call prints every value launch_module needs as CLUSTER_* assignments, quoted there with
# shlex.quote, so eval runs no outside text; a bad allocation or hostfile is its "error:" line and exit 2.
read_cluster() {
    local python assignments request=("$LAUNCHER" --gpus="$GPUS" --nodes="$NODES" --hostfile="$HOSTFILE"
        --master-addr="$MASTER_ADDR_OPT" --master-port="$MASTER_PORT_OPT")
    if ((CPU_MODE)); then request+=(--cpu); fi
    # The module needs only the standard library: a --dry-run still works where $PYTHON is not installed.
    python=$(command -v "$PYTHON" || command -v python3) ||
        die "no Python to read the cluster with (neither '$PYTHON' nor python3 runs)"
    assignments=$(PYTHONPATH=$(with_repo_on_path) "$python" -m pretrain.cluster --prog launch.sh plan "${request[@]}" \
        -- ${MODULE_ARGS[@]+"${MODULE_ARGS[@]}"}) || exit $?
    eval "$assignments"
}

# ----------------------------------------------------------------------------- distributed launch
# Parse LAUNCH OPTIONS out of "$@"; everything else is kept in MODULE_ARGS for the Python module.
parse_launch_options() {
    LAUNCHER=auto GPUS="" NODES="" HOSTFILE="" MASTER_ADDR_OPT="" MASTER_PORT_OPT="" CPU_MODE=0
    MODULE_ARGS=() VERBATIM_FROM=-1
    while (($#)); do
        case "$1" in
            --launcher) need_value "$1" $#; LAUNCHER=$2; shift 2 ;;
            --launcher=*) LAUNCHER=${1#*=}; shift ;;
            --gpus) need_value "$1" $#; GPUS=$2; shift 2 ;;
            --gpus=*) GPUS=${1#*=}; shift ;;
            --nodes) need_value "$1" $#; NODES=$2; shift 2 ;;
            --nodes=*) NODES=${1#*=}; shift ;;
            --hostfile) need_value "$1" $#; HOSTFILE=$2; shift 2 ;;
            --hostfile=*) HOSTFILE=${1#*=}; shift ;;
            --master-addr) need_value "$1" $#; MASTER_ADDR_OPT=$2; shift 2 ;;
            --master-addr=*) MASTER_ADDR_OPT=${1#*=}; shift ;;
            --master-port) need_value "$1" $#; MASTER_PORT_OPT=$2; shift 2 ;;
            --master-port=*) MASTER_PORT_OPT=${1#*=}; shift ;;
            --cpu) CPU_MODE=1; shift ;;
            --) shift; VERBATIM_FROM=${#MODULE_ARGS[@]}; MODULE_ARGS+=("$@"); break ;;
            *) MODULE_ARGS+=("$1"); shift ;;
        esac
    done
    case "$LAUNCHER" in
        auto | local | hostfile | slurm | none) ;;
        *) die "--launcher must be auto, local, hostfile, slurm or none, got '$LAUNCHER'" ;;
    esac
    [[ -z "$GPUS" ]] || { is_uint "$GPUS" && ((GPUS > 0)); } || die "--gpus must be a positive integer, got '$GPUS'"
    [[ -z "$NODES" ]] || { is_uint "$NODES" && ((NODES > 0)); } || die "--nodes must be a positive integer, got '$NODES'"
    [[ -z "$MASTER_PORT_OPT" ]] || { is_uint "$MASTER_PORT_OPT" && ((MASTER_PORT_OPT > 0 && MASTER_PORT_OPT < 65536)); } ||
        die "--master-port must be a port number (1-65535), got '$MASTER_PORT_OPT'"
    if [[ "$LAUNCHER" == auto ]]; then
        if [[ -n "$HOSTFILE" ]]; then
            LAUNCHER=hostfile
        elif [[ -n "${SLURM_JOB_ID:-}" ]]; then
            LAUNCHER=slurm
        else
            LAUNCHER=local
        fi
    fi
    [[ "$LAUNCHER" != hostfile || -n "$HOSTFILE" ]] || die "--launcher hostfile needs --hostfile FILE"
    [[ "$LAUNCHER" == hostfile || -z "$HOSTFILE" ]] || die "--hostfile cannot be combined with --launcher $LAUNCHER"
    [[ "$LAUNCHER" != slurm || -n "${SLURM_JOB_ID:-}" ]] ||
        die "--launcher slurm: not inside a SLURM allocation (SLURM_JOB_ID is unset); use sbatch/salloc"
    [[ "$LAUNCHER" != none || -z "$GPUS" || "$GPUS" == 1 ]] ||
        die "--launcher none runs one process; drop --gpus $GPUS or pick another launcher"
    [[ "$LAUNCHER" != local && "$LAUNCHER" != none || -z "$NODES" || "$NODES" == 1 ]] ||
        die "--nodes $NODES needs --hostfile or a SLURM allocation"
    if ((CPU_MODE)) && [[ -z "$GPUS" && "$LAUNCHER" != none ]]; then
        die "--cpu needs --gpus N (the number of CPU ranks per node)"
    fi
}

# The DeepSpeed launcher through the interpreter itself: a `deepspeed` script on PATH may belong to
# another environment (or vanish when upstream renames it); the module path is the same in 0.19.x.
# --no_local_rank: our modules read LOCAL_RANK from the environment and reject unknown flags.
launch_module() { # $1 = python module; MODULE_ARGS = its arguments
    local module=$1
    local ds=("$PYTHON" -m deepspeed.launcher.runner)
    FORWARD_SIGNALS=1 # see "signals" above
    if [[ "$LAUNCHER" == none ]]; then
        export_rank_env 1
        run "$PYTHON" -u -m "$module" "${MODULE_ARGS[@]}"
        return
    fi
    read_cluster
    case "$LAUNCHER" in
        local)
            export_rank_env "$CLUSTER_RANKS"
            run "${ds[@]}" "${CLUSTER_LAUNCHER_ARGS[@]}" --master_addr "$CLUSTER_MASTER_ADDR" \
                --master_port "$CLUSTER_MASTER_PORT" --no_local_rank --module "$module" "${MODULE_ARGS[@]}"
            ;;
        hostfile)
            export_rank_env "$CLUSTER_RANKS"
            write_ds_env_file "$CLUSTER_RANKS"
            # On 2+ nodes DeepSpeed starts the ranks through pdsh + ssh, a remote shell (pdsh_quote in
            # pretrain/cluster.py); with one node it runs them locally, and the arguments go as typed.
            if ((CLUSTER_REMOTE_SHELL)); then
                echo "# hostfile: the module's arguments below are quoted once more for the remote shell (pdsh + ssh)"
            fi
            run "${ds[@]}" --hostfile "$HOSTFILE" --master_addr "$CLUSTER_MASTER_ADDR" \
                --master_port "$CLUSTER_MASTER_PORT" ${CLUSTER_LAUNCHER_ARGS[@]+"${CLUSTER_LAUNCHER_ARGS[@]}"} \
                --no_local_rank --module "$module" ${CLUSTER_MODULE_ARGS[@]+"${CLUSTER_MODULE_ARGS[@]}"}
            ;;
        slurm)
            # OMP threads follow the job's --cpus-per-task, which srun gets again (CLUSTER_LAUNCHER_ARGS).
            export_rank_env "$CLUSTER_RANKS" "$CLUSTER_CPUS_PER_TASK"
            export MASTER_ADDR=$CLUSTER_MASTER_ADDR MASTER_PORT=$CLUSTER_MASTER_PORT WORLD_SIZE=$CLUSTER_WORLD_SIZE
            show export "MASTER_ADDR=$MASTER_ADDR" "MASTER_PORT=$MASTER_PORT" "WORLD_SIZE=$WORLD_SIZE"
            run srun --nodes="$CLUSTER_NODES" --ntasks-per-node="$CLUSTER_RANKS" --ntasks="$CLUSTER_WORLD_SIZE" \
                ${CLUSTER_LAUNCHER_ARGS[@]+"${CLUSTER_LAUNCHER_ARGS[@]}"} \
                --kill-on-bad-exit=1 --export=ALL bash "$REPO_ROOT/launch/slurm_rank.sh" \
                "$PYTHON" -u -m "$module" "${MODULE_ARGS[@]}"
            ;;
    esac
}

# The pdsh launcher forwards only NCCL*/PYTHON*/UCX*/MV2*/MLFLOW* variables to the other nodes;
# the rest of our defaults travel in a DeepSpeed env file (DS_ENV_FILE), which keeps the lines of
# the user's own ~/.deepspeed_env and ./.deepspeed_env (they win over our defaults).
write_ds_env_file() {
    local ranks=$1 file line candidate lines=()
    local -A user_keys=()
    for candidate in "$HOME/.deepspeed_env" "./.deepspeed_env"; do
        [[ -f "$candidate" ]] || continue
        while IFS= read -r line || [[ -n "$line" ]]; do
            [[ "$line" == *=* ]] || continue
            lines+=("$line")
            user_keys[${line%%=*}]=1
        done <"$candidate"
    done
    while IFS= read -r line; do
        [[ -n "${user_keys[${line%%=*}]:-}" ]] || lines+=("$line")
    done < <(rank_env_lines "$ranks"; if ((CPU_MODE)); then echo "DS_ACCELERATOR=cpu"; fi)
    if ((DRY_RUN)); then
        echo "# DS_ENV_FILE (exported to every node by the DeepSpeed launcher) would hold: ${lines[*]}"
        return 0
    fi
    file=$(mktemp "${TMPDIR:-/tmp}/bert-ds-env.XXXXXX")
    # The runner reads it once, at its start, on this node: it goes when launch.sh exits.
    DS_ENV_FILE_WRITTEN=$file
    trap 'rm -f "$DS_ENV_FILE_WRITTEN"' EXIT
    printf '%s\n' "${lines[@]}" >"$file"
    export DS_ENV_FILE=$file
    show export "DS_ENV_FILE=$file"
}

# ----------------------------------------------------------------------------- subcommands
cmd_prep() {
    (($#)) || die "prep needs data_prep's arguments (e.g. --wiki-dump F --vocab-size 30522 --out DIR); see './launch.sh prep --help'"
    PYTHONPATH=$(with_repo_on_path)
    export PYTHONPATH TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
    case "$1" in
        inspect)
            (($# >= 2)) || die "usage: ./launch.sh prep inspect OUT"
            require_path -d "$2" "prep inspect: '$2' is not a folder"
            run "$PYTHON" -m data_prep "$@"
            ;;
        merge) run "$PYTHON" -m data_prep "$@" ;;
        build) run "$PYTHON" -m data_prep "$@" ;;
        *) run "$PYTHON" -m data_prep build "$@" ;;
    esac
}

cmd_pretrain() {
    parse_launch_options "$@"
    local config="" i arg checked=${#MODULE_ARGS[@]}
    ((VERBATIM_FROM < 0)) || checked=$VERBATIM_FROM
    for ((i = 0; i < checked; i++)); do
        arg=${MODULE_ARGS[i]}
        case "$arg" in
            --config) config=${MODULE_ARGS[i + 1]:-} ;;
            --config=*) config=${arg#*=} ;;
            --*.*=*) ;; # --section.key=value overrides, checked by pretrain.train itself
            --*) die "pretrain: unknown option '$arg' (overrides look like --section.key=value; see ./launch.sh --help)" ;;
        esac
    done
    [[ -n "$config" ]] || die "pretrain needs --config RUN.json"
    require_path -f "$config" "pretrain: config file '$config' does not exist"
    launch_module pretrain.train
}

cmd_squad() {
    (($#)) || die "squad needs 'finetune' or 'evaluate'"
    local action=$1
    shift
    case "$action" in
        finetune)
            parse_launch_options "$@"
            MODULE_ARGS=(finetune ${MODULE_ARGS[@]+"${MODULE_ARGS[@]}"})
            launch_module pretrain.squad
            ;;
        evaluate)
            (($# >= 2)) || die "usage: ./launch.sh squad evaluate DATA.json PREDICTIONS.json [--version 2 ...]"
            local file
            for file in "$1" "$2"; do require_path -f "$file" "squad evaluate: '$file' does not exist"; done
            run "$PYTHON" -m pretrain.squad evaluate "$@"
            ;;
        *) die "squad: unknown action '$action' (use finetune or evaluate)" ;;
    esac
}

cmd_export() {
    (($# == 2)) || die "usage: ./launch.sh export CHECKPOINT OUT"
    require_path -e "$1" "export: checkpoint '$1' does not exist"
    PYTHONPATH=$(with_repo_on_path)
    export PYTHONPATH
    run "$PYTHON" -m pretrain.export "$1" "$2"
}

cmd_tensorboard() {
    (($# >= 1)) || die "usage: ./launch.sh tensorboard RUN_DIR [tensorboard options]"
    require_path -d "$1" "tensorboard: run folder '$1' does not exist"
    local logdir=$1
    shift
    run "$PYTHON" -m tensorboard.main --logdir "$logdir" "$@"
}

cmd_scale() {
    (($#)) || die "usage: ./launch.sh scale RUN.json --phase1-batch N --phase2-batch M [--gpus G] --out NEW.json"
    require_path -f "$1" "scale: run config '$1' does not exist"
    PYTHONPATH=$(with_repo_on_path)
    export PYTHONPATH
    run "$PYTHON" -m pretrain.scale "$@"
}

cmd_demo() {
    PYTHONPATH=$(with_repo_on_path)
    export PYTHONPATH
    local extra=()
    ((DRY_RUN)) && extra+=(--dry-run)
    show "$PYTHON" -m pretrain.demo "${extra[@]}" "$@"
    # The demo prints and runs its own steps, so it always runs; with --dry-run it only prints them.
    "$PYTHON" -m pretrain.demo "${extra[@]}" "$@"
}

# Launch options are also shown by 'pretrain --help' etc.
main() {
    local args=() arg seen_separator=0
    for arg in "$@"; do
        if ((seen_separator)); then
            args+=("$arg")
            continue
        fi
        case "$arg" in
            --dry-run) DRY_RUN=1 ;;
            --) seen_separator=1; args+=("$arg") ;;
            *) args+=("$arg") ;;
        esac
    done
    set -- ${args[@]+"${args[@]}"}
    (($#)) || { usage; exit 2; }
    local sub=$1
    shift
    if [[ "$sub" == -h || "$sub" == --help || "$sub" == help ]]; then
        usage
        exit 0
    fi
    # prep and demo forward --help to their Python module, which knows its own flags.
    if [[ "$sub" != demo && "$sub" != prep ]]; then
        for arg in "$@"; do
            [[ "$arg" == -- ]] && break
            if [[ "$arg" == -h || "$arg" == --help ]]; then usage; exit 0; fi
        done
    fi
    case "$sub" in
        prep) cmd_prep "$@" ;;
        pretrain) cmd_pretrain "$@" ;;
        squad) cmd_squad "$@" ;;
        export) cmd_export "$@" ;;
        tensorboard) cmd_tensorboard "$@" ;;
        demo) cmd_demo "$@" ;;
        scale) cmd_scale "$@" ;;
        *) die "unknown subcommand '$sub' (prep, pretrain, squad, export, tensorboard, scale, demo; see --help)" ;;
    esac
}

# On one line: bash reads a script as it runs, so nothing after this may be read once main returns.
main "$@"; exit
