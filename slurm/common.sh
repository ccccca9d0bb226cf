# Shared launch logic of the slurm/*.sbatch scripts. Sourced inside a batch job, never executed.
#
#   source "${REPO_DIR:-$SLURM_SUBMIT_DIR}/slurm/common.sh"
#   dapo_setup                                   # repo dir, venv, rendezvous, network and thread environment
#   dapo_train configs/x.yaml "$@"               # check the config, doctor on every task, then one trainer per task
#   dapo_train_command configs/x.yaml "$@"       # only build DAPO_TRAIN_CMD (checks included)
#   dapo_doctor configs/x.yaml "$@"              # only the pre-flight: `megatron-dapo doctor` on every task
#   dapo_srun python my_script.py                # or any other program, one copy per task
#
# Rendezvous: every task runs the same `megatron-dapo train`; init_distributed() reads its rank
# from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and meets the others at MASTER_ADDR:MASTER_PORT,
# exported here as the first host of the allocation and a port derived from the job id (the same
# formula as megatron_dapo.distributed.launch.slurm_master_port, so a task that lost the variable
# would still agree). Export MASTER_PORT before sbatch to choose it yourself.
#
# Pre-flight: before the trainer, `megatron-dapo doctor` runs once per task (versions, GPUs per task,
# memory against the plan, /dev/shm, locked memory, disk, socket interfaces, a gloo/NCCL all-reduce
# across all nodes) and prints one table into the job log; a failed check ends the job there, before
# the model loads. DAPO_DOCTOR=0 skips it.
#
# Network: gloo groups span nodes, and gloo binds to the address a node's own name resolves to
# (127.0.1.1 on many Debian-style hosts): GLOO_SOCKET_IFNAME is exported as the interface the first
# node reaches the others through, unless set. NCCL picks its own (InfiniBand first) unless
# NCCL_SOCKET_IFNAME is set. vLLM's compile cache (VLLM_CACHE_ROOT) is one node-local directory per
# node, shared by its ranks and kept across restarts, unless set.
#
# Resuming: `--resume` is passed to the trainer when given on the sbatch command line, and also
# automatically when SLURM restarts a requeued job (SLURM_RESTART_COUNT > 0: preemption, node
# failure, `scontrol requeue`) and a checkpoint exists under trainer.output_dir; a restarted job
# without one passes --overwrite (its first attempt's logs would otherwise stop the new one).

# Where the repository is: the batch script itself runs from a copy in slurmd's spool directory,
# so its own path says nothing; sbatch is run from the repository root (or REPO_DIR is exported).
DAPO_REPO_DIR="${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"

dapo_log() {
    echo "[megatron-dapo $(date +%H:%M:%S)] $*"
}

dapo_die() {
    echo "[megatron-dapo] error: $*" >&2
    exit 1
}

# Enter the repository, activate its virtualenv and export the rendezvous and thread settings.
dapo_setup() {
    [ -n "${SLURM_JOB_ID:-}" ] || dapo_die "not inside a SLURM job: submit with sbatch (see slurm/README.md)"
    [ -f "$DAPO_REPO_DIR/megatron_dapo/__init__.py" ] \
        || dapo_die "$DAPO_REPO_DIR is not the megatron-dapo repository:" \
                    "run sbatch from the repository root or export REPO_DIR"
    cd "$DAPO_REPO_DIR" || dapo_die "cannot cd to $DAPO_REPO_DIR"

    local venv="${VENV:-.venv}"
    if [ -f "$venv/bin/activate" ]; then
        # shellcheck disable=SC1091
        source "$venv/bin/activate"
    fi
    command -v python >/dev/null || dapo_die "no python on PATH (create $venv or export VENV=...)"

    # Variables of a surrounding torchrun (or of the submitting shell, which sbatch exports) would
    # win over SLURM's in resolve_launch_env and give every task the same rank: drop them.
    unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK

    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    [ -n "$MASTER_ADDR" ] || dapo_die "could not expand SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
    export MASTER_ADDR
    # launch.slurm_master_port's formula: below the kernel's ephemeral ports (32768 on), which an
    # outgoing connection could take before rank 0 binds this one.
    export MASTER_PORT="${MASTER_PORT:-$((22000 + SLURM_JOB_ID % 10000))}"

    # Threads per task: the CPUs SLURM gave it (many tasks share a node; oversubscription is slow).
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
    export PYTHONUNBUFFERED=1
    export PYTHONPATH="$DAPO_REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"

    dapo_socket_ifname
    # One compile cache per node: the same node-local path everywhere is a different directory on
    # each node; its ranks share it and a restarted or requeued job on the node finds it again.
    export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-/tmp/megatron-dapo-vllm-cache-${USER:-$(id -un)}}"

    dapo_log "job $SLURM_JOB_ID: ${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NUM_NODES:-?} node(s) ($SLURM_JOB_NODELIST)," \
        "rendezvous $MASTER_ADDR:$MASTER_PORT, gloo interface ${GLOO_SOCKET_IFNAME:-(by host name)}," \
        "restart ${SLURM_RESTART_COUNT:-0}, repo $DAPO_REPO_DIR"
}

# Export GLOO_SOCKET_IFNAME (unless set, and only across nodes) as the interface this node - the
# first of the job - reaches the other nodes through; the doctor checks it exists on every node.
dapo_socket_ifname() {
    [ -z "${GLOO_SOCKET_IFNAME:-}" ] || return 0
    [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ] || return 0
    local peers ifname
    peers="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n +2 | tr '\n' ' ')"
    # shellcheck disable=SC2086  # one argument per host
    if ifname="$(python -m megatron_dapo.distributed.socket_interfaces $peers)" && [ -n "$ifname" ]; then
        export GLOO_SOCKET_IFNAME="$ifname"
    else
        dapo_log "warning: found no interface towards $peers: export GLOO_SOCKET_IFNAME (the doctor checks it)"
    fi
}

# Run a program once per task of the allocation.
# --kill-on-bad-exit: one failing rank ends the step at once instead of leaving the others blocked
# in a collective until the timeout. CPUs per task are passed explicitly because srun 22.05+ no
# longer reads SLURM_CPUS_PER_TASK from the batch environment.
dapo_srun() {
    local opts=(--kill-on-bad-exit=1)
    [ -n "${SLURM_CPUS_PER_TASK:-}" ] && opts+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
    # shellcheck disable=SC2086  # SRUN_EXTRA_ARGS is a list of options on purpose
    srun "${opts[@]}" ${SRUN_EXTRA_ARGS:-} "$@"
}

# dapo_train_command DEFAULT_CONFIG [--config FILE] [--resume|--overwrite] [key=value ...] [other trainer flags]
# Sets DAPO_TRAIN_CMD (an array) to the trainer command line, after the checks, without running it.
# The config is --config if given, else $CONFIG, else DEFAULT_CONFIG. The batch shell checks the
# config and its parallel layout against the number of tasks first (a typo fails here in a second,
# not after the queue and the model load).
dapo_train_command() {
    local config="${CONFIG:-$1}"
    shift
    local train_args=() overrides=() resume=0 overwrite=0
    while [ $# -gt 0 ]; do
        case "$1" in
            --config) [ $# -ge 2 ] || dapo_die "--config needs a file"; config="$2"; shift 2; continue ;;
            --config=*) config="${1#--config=}" ;;
            --resume) resume=1 ;;
            --overwrite) overwrite=1 ;;
            -*) train_args+=("$1") ;;
            *=*) overrides+=("$1"); train_args+=("$1") ;;
            *) train_args+=("$1") ;;
        esac
        shift
    done
    [ -f "$config" ] || dapo_die "config file '$config' not found (relative to $PWD)"

    local resolved output_dir
    resolved="$(python -m megatron_dapo.cli config "$config" "${overrides[@]}" --world-size "${SLURM_NTASKS:-1}")" \
        || dapo_die "configuration check failed (see above)"
    output_dir="$(printf '%s' "$resolved" \
        | python -c 'import json, sys; print(json.load(sys.stdin)["trainer"]["output_dir"])')"

    if [ "$resume" = 0 ] && [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
        if [ -e "$output_dir/checkpoints/latest" ]; then
            dapo_log "restart ${SLURM_RESTART_COUNT} of a requeued job:" \
                "resuming from $output_dir/checkpoints/$(cat "$output_dir/checkpoints/latest")"
            resume=1 overwrite=0  # a job submitted with --overwrite continues what it wrote since
        else  # the first attempt of this job left logs but no checkpoint: start it over
            dapo_log "restart ${SLURM_RESTART_COUNT} of a requeued job without a checkpoint: starting over (--overwrite)"
            overwrite=1
        fi
    fi
    DAPO_TRAIN_CMD=(python -m megatron_dapo.cli train --config "$config")
    [ "$resume" = 1 ] && DAPO_TRAIN_CMD+=(--resume)
    [ "$overwrite" = 1 ] && DAPO_TRAIN_CMD+=(--overwrite)
    DAPO_TRAIN_CMD+=("${train_args[@]}")
    dapo_log "${DAPO_TRAIN_CMD[*]:3} -> $output_dir"
}

# dapo_doctor DEFAULT_CONFIG [--config FILE] [key=value ...] [other arguments, ignored]
# `megatron-dapo doctor` on every task with the job's config and overrides; stops the job on a failed
# check (the table in the job log says what to change). DAPO_DOCTOR=0 skips it.
dapo_doctor() {
    local config="${CONFIG:-$1}"
    shift
    if [ "${DAPO_DOCTOR:-1}" = 0 ]; then
        dapo_log "doctor skipped (DAPO_DOCTOR=0)"
        return 0
    fi
    local overrides=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --config) [ $# -ge 2 ] || dapo_die "--config needs a file"; config="$2"; shift 2; continue ;;
            --config=*) config="${1#--config=}" ;;
            -*) ;;  # the trainer's (or demo's) own flags
            *=*) overrides+=("$1") ;;
        esac
        shift
    done
    dapo_log "doctor: ${SLURM_NTASKS:-1} task(s) check the nodes for $config"
    dapo_srun python -m megatron_dapo.cli doctor --config "$config" "${overrides[@]}" \
        || dapo_die "the doctor found a problem (its table above says what to change); DAPO_DOCTOR=0 skips it"
}

# dapo_train DEFAULT_CONFIG [args...]: dapo_train_command, the doctor on every task, then one trainer per task.
dapo_train() {
    dapo_train_command "$@"
    dapo_doctor "$@"
    dapo_srun "${DAPO_TRAIN_CMD[@]}"
}
