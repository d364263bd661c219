#!/usr/bin/env bash
# launch.sh: the one entry point of the toolkit, from a 2-core laptop to a SLURM cluster.
#
#   ./launch.sh [--dry-run] SUBCOMMAND [options]      (./launch.sh --help for the list)
#
# Every subcommand prints the exact command it runs, prefixed with "+ " and shell-quoted so it
# can be copied; --dry-run prints it and runs nothing. Nothing here is site-specific: the
# interpreter is $PYTHON (see default_python), and cluster knobs come from the environment
# (NCCL_*, OMP_NUM_THREADS), which launch.sh only fills in when they are unset. What is logic
# rather than launching (the launch options, what the cluster says, the ranks' environment, the
# --help text) is Python with unit tests: pretrain/launch/plan.py and pretrain/distributed/cluster.py.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DRY_RUN=0
# Every Python process started from here: `python -m` would put the working folder first on the import path, so a
# `numpy.py` planted in a shared working folder would run as you. The toolkit is installed or on PYTHONPATH.
export PYTHONSAFEPATH=1
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
    run_forwarding_signals "$@"
}

# ----------------------------------------------------------------------------- signals
# A supervisor stops a job by signalling launch.sh or its process group: SIGTERM (a scheduler, a
# container runtime), SIGUSR1 (SLURM before the time limit), SIGINT (Ctrl-C), SIGHUP (a closed
# terminal: passed on as SIGTERM). The ranks must get it, checkpoint and exit, and launch.sh must wait
# for them and exit with their status (130 after a Ctrl-C stop, the shell's code for an interrupted
# command, although the ranks checkpointed and exited 0). So every command runs in a process group of
# its own (a signal to ours reaches launch.sh only) and launch.sh delivers each signal itself: with the
# local DeepSpeed launcher straight to the ranks, its grandchildren (that launcher would SIGKILL them
# 30 s after forwarding, dies of SIGUSR1 and exits 1 whatever the ranks did); with one plain rank to it;
# srun gets SIGINT as SIGTERM (one SIGINT only makes srun print its tasks' states), the pdsh runner
# SIGUSR1 as SIGTERM (it handles TERM and INT only); any other subcommand (tensorboard, the demo,
# export, ...) to its whole group, as a terminal would. A rank still starting (no handler yet: it would
# print a KeyboardInterrupt traceback) gets SIGTERM for SIGINT: it has nothing to save.
# launch.sh may also die without a word (SIGKILL of it or of its group): a watchdog in a group of its own
# (pretrain/launch/watchdog.py) then stops the command's group, SIGTERM and SIGKILL 30 s later
# (BERT_DS_KILL_GRACE_SECONDS), so nothing of the job outlives launch.sh.
CHILD_PID="" PENDING_SIGNAL="" LAUNCHER="" WATCHDOG_PID="" INTERRUPTED=0 AGENT=0 FORWARDED=0

# shellcheck disable=SC2206 # the fields of a stat line: split on purpose
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
    case "$LAUNCHER" in
        local) if ((AGENT)); then echo "$CHILD_PID"; else for launcher in $(child_pids "$CHILD_PID"); do child_pids "$launcher"; done; fi ;;
        none | slurm | hostfile) echo "$CHILD_PID" ;;
        *) echo "-$CHILD_PID" ;; # not a distributed launch: the command's whole process group
    esac
    return 0
}

catches_sigterm() { # $1 = pid: whether it has a SIGTERM handler (bit 15 of SigCgt in /proc/PID/status)
    local key mask
    while read -r key mask; do
        if [[ "$key" == SigCgt: ]]; then (((16#$mask >> 14) & 1)) && return 0 || return 1; fi
    done <"/proc/$1/status" 2>/dev/null
    return 1
}

# shellcheck disable=SC2086 # $targets: one word per pid
deliver_pending() {
    local signal=$PENDING_SIGNAL targets target
    [[ "$LAUNCHER" != hostfile || "$signal" != USR1 ]] || signal=TERM
    [[ "$LAUNCHER" != slurm || "$signal" != INT ]] || signal=TERM
    targets=$(signal_targets)
    [[ -n "$targets" ]] || return 0 # retried while waiting
    echo "launch.sh: forwarding SIG$signal to" $targets >&2 || true # a closed terminal must not stop us here
    for target in $targets; do
        if [[ "$signal" == INT && "$LAUNCHER" =~ ^(local|none)$ ]] && ! catches_sigterm "$target"; then
            kill -s TERM "$target" 2>/dev/null || true
        else
            kill -s "$signal" -- "$target" 2>/dev/null || true
        fi
    done
    PENDING_SIGNAL=""
}

# shellcheck disable=SC2317 # runs from the traps below
on_signal() {
    [[ "$1" != INT ]] || INTERRUPTED=1
    FORWARDED=1
    PENDING_SIGNAL=$1
    deliver_pending
}

# The watchdog: in a group of its own, so that a SIGKILL of launch.sh's group spares it.
start_watchdog() {
    set -m
    PYTHONPATH=$(with_repo_on_path) "$PYTHON" -m pretrain.launch.watchdog $$ "$CHILD_PID" \
        --grace "${BERT_DS_KILL_GRACE_SECONDS:-30}" </dev/null &
    WATCHDOG_PID=$!
    set +m
}

# Run "$@" in the background, in its own process group, and return its exit status once it is gone;
# signals that reach launch.sh meanwhile are delivered as described above.
run_forwarding_signals() {
    local status=0
    trap 'on_signal TERM' TERM
    trap 'on_signal INT' INT
    trap 'on_signal USR1' USR1
    trap 'on_signal TERM' HUP
    # Job control: the child leads a new process group and keeps SIGINT (not ignored). Its stdin is
    # /dev/null: a background group reading the terminal (srun, ssh under pdsh) would be stopped.
    set -m
    "$@" </dev/null &
    CHILD_PID=$!
    set +m
    start_watchdog
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
    kill -s TERM "$WATCHDOG_PID" 2>/dev/null || true # the job ended by itself: nothing left to watch
    kill -s TERM -- "-$CHILD_PID" 2>/dev/null || true  # what it left in its group (a compiler of a killed rank)
    trap - TERM INT USR1 HUP
    if ((INTERRUPTED && status == 0)); then status=130; fi
    return "$status"
}

# An input that an earlier step produces may be missing in a --dry-run of a pipeline: warn there.
require_path() { # $1 = test flag (-f/-d/-e), $2 = path, $3 = message
    if test "$1" "$2"; then return 0; fi
    ((DRY_RUN)) || die "$3"
    echo "launch.sh: note: $3 (continuing: --dry-run)" >&2
}

# ----------------------------------------------------------------------------- environment
# $PYTHONPATH with the checkout in front (once), so `-m pretrain.train` resolves without an install.
with_repo_on_path() {
    case ":${PYTHONPATH:-}:" in
        *":$REPO_ROOT:"*) echo "$PYTHONPATH" ;;
        *) echo "${REPO_ROOT}${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
}

export_repo_path() { PYTHONPATH=$(with_repo_on_path) && export PYTHONPATH; }

cpu_count() { nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1; }

# python -m pretrain.launch.plan: standard library only, so a --dry-run still works where $PYTHON is
# not installed (python3 then).
launch_plan() {
    local python
    python=$(command -v "$PYTHON" || command -v python3) ||
        die "no Python to read the cluster with (neither '$PYTHON' nor python3 runs)"
    PYTHONPATH=$(with_repo_on_path) "$python" -m pretrain.launch.plan --prog launch.sh "$@"
}

usage() { launch_plan usage; }

# ----------------------------------------------------------------------------- distributed launch
# launch_plan.py checks the launch options (and pretrain's --config), chooses the launcher, reads the
# cluster and prints LAUNCHER, HOSTFILE, MODULE_ARGS, CLUSTER_*, RANK_ENV and DS_ENV as assignments,
# every value shlex.quote'd, so eval runs no outside text; bad input is its "error:" line and exit 2.
# The DeepSpeed launcher runs through the interpreter: a `deepspeed` script on PATH may belong to
# another environment. --no_local_rank: our modules read LOCAL_RANK from the environment.
launch_module() { # $1 = python module, $2 = pretrain|finetune, then the subcommand's arguments
    local module=$1 plan line request=(launch --cpu-count="$(cpu_count)" "$2")
    local ds=("$PYTHON" -m deepspeed.launcher.runner)
    shift 2
    if ((DRY_RUN)); then request+=(--dry-run); fi
    # pretrain: the run's launch-time check too (config, DeepSpeed JSONs, batch, shards, run folder; one
    # process, seconds, no torch): a problem is one line and exit 2 before any launcher, rank or node starts.
    if [[ "${request[2]}" == pretrain ]]; then request+=(--check-run); fi
    plan=$(launch_plan "${request[@]}" -- "$@") || exit $?
    eval "$plan"
    for line in "${RANK_ENV[@]}"; do export "${line?}"; done
    show export "${RANK_ENV[@]}"
    case "$LAUNCHER" in
        none) run "$PYTHON" -u -m "$module" "${MODULE_ARGS[@]}" ;;
        local)
            if [[ "$module" == pretrain.train ]]; then
                run_agent "$@"
                return
            fi
            run "${ds[@]}" "${CLUSTER_LAUNCHER_ARGS[@]}" --master_addr "$CLUSTER_MASTER_ADDR" \
                --master_port "$CLUSTER_MASTER_PORT" --no_local_rank --module "$module" "${MODULE_ARGS[@]}"
            ;;
        hostfile)
            write_ds_env_file
            if [[ "$module" == pretrain.train ]]; then
                run_nodes "$@"
                return
            fi
            # On 2+ nodes DeepSpeed starts the ranks through pdsh + ssh, a remote shell (pdsh_quote in
            # pretrain/distributed/cluster.py); with one node it runs them locally, and the arguments go as typed.
            if ((CLUSTER_REMOTE_SHELL)); then
                echo "# hostfile: the module's arguments below are quoted once more for the remote shell (pdsh + ssh)"
                run_finetune_nodes "$module"
                return
            fi
            run "${ds[@]}" --hostfile "$HOSTFILE" --master_addr "$CLUSTER_MASTER_ADDR" \
                --master_port "$CLUSTER_MASTER_PORT" ${CLUSTER_LAUNCHER_ARGS[@]+"${CLUSTER_LAUNCHER_ARGS[@]}"} \
                --no_local_rank --module "$module" "${MODULE_ARGS[@]}"
            ;;
        slurm)
            if [[ "$module" == pretrain.train ]]; then
                run_nodes --slurm "$@"
                return
            fi
            export MASTER_ADDR=$CLUSTER_MASTER_ADDR MASTER_PORT=$CLUSTER_MASTER_PORT WORLD_SIZE=$CLUSTER_WORLD_SIZE
            show export "MASTER_ADDR=$MASTER_ADDR" "MASTER_PORT=$MASTER_PORT" "WORLD_SIZE=$WORLD_SIZE"
            # CLUSTER_LAUNCHER_ARGS: the job's --cpus-per-task, which srun no longer inherits (Slurm 22.05).
            run srun --nodes="$CLUSTER_NODES" --ntasks-per-node="$CLUSTER_RANKS" --ntasks="$CLUSTER_WORLD_SIZE" \
                ${CLUSTER_LAUNCHER_ARGS[@]+"${CLUSTER_LAUNCHER_ARGS[@]}"} \
                --kill-on-bad-exit=1 --export=ALL bash "$REPO_ROOT/slurm/slurm_rank.sh" \
                "$PYTHON" -u -m "$module" "${MODULE_ARGS[@]}"
            ;;
    esac
}

# pretrain on this machine: torch's elastic agent with our fault lines (restarts, hangs, per-rank logs in the
# run folder; pretrain/launch/agent.py), which passes launch.sh's signals on to the ranks itself.
run_agent() { # the pretrain arguments as typed: the error line's resume command
    local resume
    resume=$(show ./launch.sh pretrain "$@")
    AGENT=1
    local status=0
    run "$PYTHON" -m pretrain.launch.agent --nproc-per-node "$CLUSTER_RANKS" --master-addr "$CLUSTER_MASTER_ADDR" \
        --master-port "$CLUSTER_MASTER_PORT" --resume-command "${resume#+ }" -- "${MODULE_ARGS[@]}" || status=$?
    # The agent itself killed (its ranks die with it: pretrain/distributed/process_group.py), not stopped by us.
    if ((status > 128 && !FORWARDED)); then
        echo "launch.sh: error: the elastic agent died of SIG$(kill -l $((status - 128)) 2>/dev/null || echo $((status - 128)));" \
            "its ranks ended with it; resume with: ${resume#+ }" >&2
    fi
    return "$status"
}

# pretrain on several nodes: the same agent on every node, started by pretrain/launch/nodes.py through pdsh + ssh
# (a hostfile) or srun (one task per node of a SLURM allocation), which serves their rendezvous store on this machine
# (or checks the one --rdzv-endpoint names), tells a lost node (--nodes MIN:MAX: the job carries on without it) and
# passes signals to every node.
run_nodes() { # [--slurm] then the pretrain arguments as typed: the error line's resume command
    local resume where=(--hostfile "$HOSTFILE") extra=()
    if [[ "${1:-}" == --slurm ]]; then
        shift
        # every node of the allocation (or --nodes) runs an agent; a task asks for its ranks' CPUs and GPUs
        where=(--slurm --nodes "${NODE_RANGE:-$CLUSTER_NODES}")
        extra=(${CLUSTER_CPUS_PER_TASK:+--cpus-per-task "$CLUSTER_CPUS_PER_TASK"})
        if [[ "${DS_ACCELERATOR:-}" != cpu ]]; then extra+=(--gpus); fi
    else
        where+=(${NODE_RANGE:+--nodes "$NODE_RANGE"} ${DS_ENV_FILE:+--env-file "$DS_ENV_FILE"})
    fi
    resume=$(show ./launch.sh pretrain "$@")
    if ((CLUSTER_REMOTE_SHELL)); then
        echo "# hostfile: the module's arguments below are quoted once more for the remote shell (pdsh + ssh)"
        extra+=(--args-quoted) # pdsh always runs a remote shell; with 2+ nodes launch/plan.py quoted them already
    fi
    local nodes=(-m pretrain.launch.nodes "${where[@]}" ${extra[@]+"${extra[@]}"} --nproc-per-node "$CLUSTER_RANKS"
        --rdzv-endpoint "$CLUSTER_RDZV_ENDPOINT" --resume-command "${resume#+ }")
    run "$PYTHON" "${nodes[@]}" -- "${MODULE_ARGS[@]}"
    if ((DRY_RUN)); then # what it would start on the nodes (pdsh or srun), as one line
        echo "# which starts: $(PYTHONPATH=$(with_repo_on_path) "$(command -v "$PYTHON" || echo python3)" "${nodes[@]}" \
            --python "$PYTHON" --show -- "${MODULE_ARGS[@]}")"
    fi
}

# squad/glue finetune on 2+ nodes: DeepSpeed's runner starts the ranks through pdsh and would put every line of its
# env file, and every MLFLOW*/PYTHON*/UCX*/MV2*/NCCL* variable, on pdsh's command line (readable by every user with
# ps) and in its log. So it gets only RANK_ENV (our defaults, printed above anyway): pretrain.launch.node_env ships the
# rest in a 0600 file on the working folder (0700 folder, removed at exit) and each rank's command (--no_python)
# sources that file on its node, then becomes the rank.
RUNNER_ENV_FILE=/dev/null
run_finetune_nodes() { # $1 = the module
    local shipped request=(ship --python "$PYTHON") unset=() name
    if ((DRY_RUN)); then request+=(--dry-run); else request+=(--env-file "$DS_ENV_FILE"); fi
    shipped=$(PYTHONPATH=$(with_repo_on_path) "$(command -v "$PYTHON" || echo python3)" -m pretrain.launch.node_env \
        --prog launch.sh "${request[@]}") || exit $?
    eval "$shipped" # NODE_ENV_DIR, RUNNER_UNSET, NODE_ENV_EXEC: shlex.quote'd assignments
    if ! ((DRY_RUN)); then
        RUNNER_ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/bert-ds-runner-env.XXXXXX")
        trap 'rm -f "$DS_ENV_FILE" "$RUNNER_ENV_FILE"; rm -rf "$NODE_ENV_DIR"' EXIT
        printf '%s\n' "${RANK_ENV[@]}" >"$RUNNER_ENV_FILE"
    fi
    for name in ${RUNNER_UNSET[@]+"${RUNNER_UNSET[@]}"}; do unset+=(-u "$name"); done
    run env ${unset[@]+"${unset[@]}"} DS_ENV_FILE="$RUNNER_ENV_FILE" "${ds[@]}" --hostfile "$HOSTFILE" \
        --master_addr "$CLUSTER_MASTER_ADDR" --master_port "$CLUSTER_MASTER_PORT" \
        ${CLUSTER_LAUNCHER_ARGS[@]+"${CLUSTER_LAUNCHER_ARGS[@]}"} --no_local_rank --no_python "${NODE_ENV_EXEC[@]}" \
        "$1" "${MODULE_ARGS[@]}"
}

# The pdsh launcher forwards few variables to the other nodes; the rest of RANK_ENV (and the lines
# of the user's own ~/.deepspeed_env and ./.deepspeed_env) travel in a DeepSpeed env file: DS_ENV. A 0600 temp
# file, read here; pretrain.launch.nodes ships it to the nodes in a 0600 file on the working folder, never on a
# command line. --dry-run names the variables, never their values (tokens and keys live there).
write_ds_env_file() {
    if ((DRY_RUN)); then
        echo "# DS_ENV_FILE (exported to every node) would set: ${DS_ENV[*]%%=*}"
        return 0
    fi
    DS_ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/bert-ds-env.XXXXXX")
    trap 'rm -f "$DS_ENV_FILE"' EXIT # the runner reads it once, at its start: it goes when launch.sh exits
    printf '%s\n' "${DS_ENV[@]}" >"$DS_ENV_FILE"
    export DS_ENV_FILE
    show export "DS_ENV_FILE=$DS_ENV_FILE"
}

# ----------------------------------------------------------------------------- subcommands
cmd_prep() {
    (($#)) || die "prep needs data_prep's arguments (e.g. --wiki-dump F --vocab-size 30522 --out DIR); see './launch.sh prep --help'"
    export_repo_path
    export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
    case "$1" in
        inspect)
            (($# >= 2)) || die "usage: ./launch.sh prep inspect OUT"
            require_path -d "$2" "prep inspect: '$2' is not a folder"
            run "$PYTHON" -m data_prep "$@"
            ;;
        merge | build | task) run "$PYTHON" -m data_prep "$@" ;;
        *) run "$PYTHON" -m data_prep build "$@" ;;
    esac
}

cmd_squad() {
    (($#)) || die "squad needs 'finetune' or 'evaluate'"
    local action=$1
    shift
    case "$action" in
        finetune) launch_module pretrain.finetune.squad finetune "$@" ;;
        evaluate)
            (($# >= 2)) || die "usage: ./launch.sh squad evaluate DATA.json PREDICTIONS.json [--version 2 ...]"
            local file
            for file in "$1" "$2"; do require_path -f "$file" "squad evaluate: '$file' does not exist"; done
            export_repo_path
            run "$PYTHON" -m pretrain.finetune.squad evaluate "$@"
            ;;
        *) die "squad: unknown action '$action' (use finetune or evaluate)" ;;
    esac
}

cmd_glue() {
    (($#)) || die "glue needs 'finetune' or 'evaluate'"
    local action=$1
    shift
    case "$action" in
        finetune) launch_module pretrain.finetune.glue finetune "$@" ;;
        evaluate) # the module checks its files (one line naming a missing or malformed one, exit 2)
            (($# >= 4)) || die "usage: ./launch.sh glue evaluate --task TASK GOLD.tsv PREDICTIONS.tsv"
            export_repo_path
            run "$PYTHON" -m pretrain.finetune.glue evaluate "$@"
            ;;
        *) die "glue: unknown action '$action' (use finetune or evaluate)" ;;
    esac
}

cmd_export() {
    export_repo_path
    if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then run "$PYTHON" -m pretrain.export --help; return; fi
    [[ $# == 2 || ($# == 4 && "$3" == --tag) ]] || die "usage: ./launch.sh export CHECKPOINT OUT [--tag TAG]"
    require_path -e "$1" "export: checkpoint '$1' does not exist"
    run "$PYTHON" -m pretrain.export "$@"
}

cmd_tensorboard() {
    local dirs=() dir spec=""
    while (($#)) && [[ "$1" != -* ]]; do dirs+=("$1") && shift; done # the folders, then TensorBoard's options
    ((${#dirs[@]})) || die "usage: ./launch.sh tensorboard RUN_DIR [RUN_DIR ...] [tensorboard options]"
    for dir in "${dirs[@]}"; do require_path -d "$dir" "tensorboard: run folder '$dir' does not exist"; done
    if ((${#dirs[@]} == 1)); then
        run "$PYTHON" -m tensorboard.main --logdir "${dirs[0]}" "$@"
        return
    fi
    # Several (runs/demo-*/run): one TensorBoard, each folder a run group named after its path (no leading /:
    # TensorBoard would read "/a:/a" as one path), in --logdir_spec, which splits at "," and ":".
    for dir in "${dirs[@]}"; do
        [[ "$dir" != *[,:]* ]] || die "tensorboard: '$dir' has ',' or ':', which --logdir_spec cannot hold; show it alone"
        spec+="${spec:+,}$(printf '%s' "$dir" | sed -e 's|^[./]*||' -e 's|/*$||'):$dir"
    done
    run "$PYTHON" -m tensorboard.main --logdir_spec "$spec" "$@"
}

cmd_scale() {
    (($#)) || die "usage: ./launch.sh scale RUN.json --phase1-batch N --phase2-batch M [--gpus G] --out NEW.json"
    require_path -f "$1" "scale: run config '$1' does not exist"
    export_repo_path
    run "$PYTHON" -m pretrain.launch.scale "$@"
}

cmd_demo() {
    export_repo_path
    local extra=()
    ((DRY_RUN)) && extra+=(--dry-run)
    show "$PYTHON" -m pretrain.demo "${extra[@]}" "$@"
    # The demo prints and runs its own steps, so it always runs; with --dry-run it only prints them.
    run_forwarding_signals "$PYTHON" -m pretrain.demo "${extra[@]}" "$@"
}

cmd_report() {
    (($#)) || die "usage: ./launch.sh report RUN_DIR [--usd-per-device-hour X]"
    export_repo_path
    if [[ "$1" != -* ]]; then require_path -d "$1" "report: run folder '$1' does not exist"; fi
    run "$PYTHON" -m pretrain.report "$@"
}

# Launch options are also shown by 'pretrain --help' etc.
main() {
    local args=() arg seen_separator=0
    for arg in "$@"; do # --dry-run anywhere before a "--"
        if [[ "$arg" == --dry-run ]] && ! ((seen_separator)); then DRY_RUN=1; continue; fi
        [[ "$arg" != -- ]] || seen_separator=1
        args+=("$arg")
    done
    set -- ${args[@]+"${args[@]}"}
    (($#)) || { usage; exit 2; }
    local sub=$1
    shift
    if [[ "$sub" == -h || "$sub" == --help || "$sub" == help ]]; then
        usage
        exit 0
    fi
    # prep, demo, report and export forward --help to their Python module, which knows its own flags.
    if [[ "$sub" != demo && "$sub" != prep && "$sub" != report && "$sub" != export ]]; then
        for arg in "$@"; do
            [[ "$arg" == -- ]] && break
            if [[ "$arg" == -h || "$arg" == --help ]]; then usage; exit 0; fi
        done
    fi
    case "$sub" in
        prep) cmd_prep "$@" ;;
        pretrain) launch_module pretrain.train pretrain "$@" ;;
        squad) cmd_squad "$@" ;;
        glue) cmd_glue "$@" ;;
        export) cmd_export "$@" ;;
        tensorboard) cmd_tensorboard "$@" ;;
        demo) cmd_demo "$@" ;;
        scale) cmd_scale "$@" ;;
        report) cmd_report "$@" ;;
        *) die "unknown subcommand '$sub' (prep, pretrain, squad, glue, export, report, tensorboard, scale, demo; see --help)" ;;
    esac
}

# On one line: bash reads a script as it runs, so nothing after this may be read once main returns.
main "$@"; exit
