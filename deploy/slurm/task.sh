#!/usr/bin/env bash
# One Slurm task of an offpolicy job (started by offpolicy.sbatch through srun): picks this task's GPUs,
# index and metrics port from the Slurm task environment, then execs the daemon.
#
#   task.sh learner ARGS...   offpolicy-learner ARGS (a colocated learner keeps the first
#                             OFFPOLICY_LEARNER_GPUS GPUs; otherwise it sees every GPU of its node)
#   task.sh rollout ARGS...   offpolicy-rollout --index SLURM_PROCID ARGS metrics.port=OFFPOLICY_METRICS_PORT+1+index,
#                             on GPUs [offset + localid*G, offset + (localid+1)*G) of the node's list
#   task.sh eval ARGS...      offpolicy-eval ARGS metrics.port=OFFPOLICY_EVAL_METRICS_PORT, on GPUs
#                             OFFPOLICY_EVAL_GPUS (indices into the node's list; unset = CPU)
#   task.sh relay ARGS...     offpolicy-relay --index SLURM_PROCID ARGS (one task per rollout node, in the
#                             step's node order: the chain order every relay computes from the node list)
#   task.sh relay-source ARGS...   offpolicy-relay --serve --index SLURM_PROCID ARGS: a learner on several nodes,
#                             one task per learner node in the learner's node order (relay.sources), each
#                             serving its node's part of every version
#   task.sh server ARGS...    server.py --index SLURM_PROCID --host OFFPOLICY_SERVER_HOST ARGS: rollout i's vLLM or
#                             SGLang server (OFFPOLICY_SERVERS: vllm or sglang), on the GPUs rollout i would take
#                             (port rollout.<engine>.server_port + i)
#
# A rollout daemon and a server run under offpolicy-supervise (services/supervise_task.py): Slurm restarts
# nothing inside a job, so this task restarts its process (its whole process group killed first) with
# run.supervise's backoff and budget, as `offpolicy run` does; run.supervise.restart=false makes it give up at the
# first unexpected exit, OFFPOLICY_SUPERVISE=0 execs the process directly (docs/operations.md).
#
# Environment: OFFPOLICY_GPUS_PER_SERVER (G, 0 = CPU), OFFPOLICY_GPU_OFFSET, OFFPOLICY_LEARNER_GPUS,
# OFFPOLICY_METRICS_PORT (0 = off), OFFPOLICY_GPUS_PER_NODE (used when CUDA_VISIBLE_DEVICES is unset),
# OFFPOLICY_SERVERS and OFFPOLICY_SERVER_PORT (set when the job runs a server step: rollout i then talks to its
# node's server at rollout.<OFFPOLICY_SERVERS>.urls=[http://127.0.0.1:OFFPOLICY_SERVER_PORT+i] and leaves the GPUs
# to it), OFFPOLICY_PYTHON (server: [python3]).
set -euo pipefail

die() { echo "task.sh: $*" >&2; exit 2; }
[[ $# -ge 1 ]] || die "usage: task.sh learner|rollout|eval|relay|relay-source|server ARGS..."
role=$1
shift

# This node's GPUs: what Slurm made visible to the step, else 0..OFFPOLICY_GPUS_PER_NODE-1.
gpu_list() {
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    tr ',' ' ' <<<"$CUDA_VISIBLE_DEVICES"
  else
    seq -s ' ' 0 $(( ${OFFPOLICY_GPUS_PER_NODE:-0} - 1 ))
  fi
}

# CUDA_VISIBLE_DEVICES = GPUs [first, first + count) of gpu_list, or die naming the shortfall.
use_gpus() {
  local first=$1 count=$2 gpus
  read -r -a gpus <<<"$(gpu_list)"
  (( first + count <= ${#gpus[@]} )) ||
    die "$role task ${SLURM_PROCID:-?} needs GPUs $first..$((first + count - 1)) but this node shows ${#gpus[@]} " \
        "(CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES:-}'); submit with --gpus-per-node or lower --gpus-per-server"
  export CUDA_VISIBLE_DEVICES
  CUDA_VISIBLE_DEVICES=$(tr ' ' ',' <<<"${gpus[*]:first:count}")
}

# exec the command, under offpolicy.services.supervise_task (the run.supervise policy) unless it is turned off;
# supervised NAME [--always] -- CMD ARGS... (the run config's arguments are this task's "$@")
supervised() {
  local name=$1 always=()
  shift
  [[ $1 == --always ]] && { always=(--always); shift; }
  shift  # --
  if [[ ${OFFPOLICY_SUPERVISE:-1} == 0 ]]; then exec "$@"; fi
  exec offpolicy-supervise "${daemon_args[@]}" --name "$name" "${always[@]}" -- "$@"
}

case $role in
  learner)
    learner_gpus=${OFFPOLICY_LEARNER_GPUS:-0}
    (( learner_gpus > 0 )) && use_gpus 0 "$learner_gpus"
    echo "task.sh: learner rank ${SLURM_PROCID:-0} on ${SLURMD_NODENAME:-$(hostname -s)}, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-}" >&2
    exec offpolicy-learner "$@"
    ;;
  rollout|server)
    index=${SLURM_PROCID:?task.sh $role runs under srun (SLURM_PROCID unset)}
    per_server=${OFFPOLICY_GPUS_PER_SERVER:-0}
    servers=${OFFPOLICY_SERVERS:-}
    server_port=${OFFPOLICY_SERVER_PORT:-0}
    [[ -n $servers || ( $role == rollout && $server_port == 0 ) ]] ||
      die "task.sh $role: OFFPOLICY_SERVERS (vllm or sglang) is unset;" \
          "the server step sets it with OFFPOLICY_SERVER_PORT"
    if (( per_server > 0 )) && [[ $role == server || $server_port == 0 ]]; then
      use_gpus $(( ${OFFPOLICY_GPU_OFFSET:-0} + ${SLURM_LOCALID:-0} * per_server )) "$per_server"
    else
      export CUDA_VISIBLE_DEVICES=""  # a CPU rollout, or a daemon whose server has its GPUs
    fi
    node=${SLURMD_NODENAME:-$(hostname -s)}
    daemon_args=("$@")
    if [[ $role == server ]]; then
      echo "task.sh: $servers server $index on $node, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES}" >&2
      supervised "$servers-$index" --always -- "${OFFPOLICY_PYTHON:-python3}" "$(dirname "$0")/server.py" \
        --index "$index" --host "${OFFPOLICY_SERVER_HOST:-127.0.0.1}" "$@"
    fi
    extra=()
    port=${OFFPOLICY_METRICS_PORT:-0}
    (( port > 0 )) && extra+=("metrics.port=$(( port + 1 + index ))")
    (( server_port > 0 )) && extra+=("rollout.$servers.urls=[http://127.0.0.1:$(( server_port + index ))]")
    echo "task.sh: rollout $index on $node, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES}" >&2
    supervised "rollout-$index" -- offpolicy-rollout --index "$index" "$@" "${extra[@]}"
    ;;
  eval)
    read -r -a gpus <<<"$(gpu_list)"
    export CUDA_VISIBLE_DEVICES=""  # CPU unless OFFPOLICY_EVAL_GPUS names GPUs of this node (eval.gpus)
    if [[ -n ${OFFPOLICY_EVAL_GPUS:-} ]]; then
      picked=()
      for g in ${OFFPOLICY_EVAL_GPUS//,/ }; do
        (( g < ${#gpus[@]} )) || die "eval.gpus names GPU $g but this node shows ${#gpus[@]} (${gpus[*]:-none})"
        picked+=("${gpus[g]}")
      done
      CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${picked[*]}")
    fi
    metrics=()
    (( ${OFFPOLICY_EVAL_METRICS_PORT:-0} > 0 )) && metrics=("metrics.port=$OFFPOLICY_EVAL_METRICS_PORT")
    echo "task.sh: eval on ${SLURMD_NODENAME:-$(hostname -s)}, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES}" >&2
    exec offpolicy-eval "$@" "${metrics[@]}"
    ;;
  relay)
    export CUDA_VISIBLE_DEVICES=""
    exec offpolicy-relay --index "${SLURM_PROCID:?task.sh relay runs under srun (SLURM_PROCID unset)}" "$@"
    ;;
  relay-source)
    export CUDA_VISIBLE_DEVICES=""
    exec offpolicy-relay --serve --index "${SLURM_PROCID:?task.sh relay-source runs under srun (SLURM_PROCID unset)}" "$@"
    ;;
  *) die "unknown role '$role'; use learner, rollout, eval, relay, relay-source or server" ;;
esac
