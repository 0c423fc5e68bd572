#!/usr/bin/env bash
# A Slurm cluster on this machine, for tests and for trying deploy/slurm/offpolicy.sbatch.
#
#   deploy/slurm/local-cluster.sh start DIR [--nodes N] [--cpus N] [--ctld-port P] [--slurmd-port P]
#   export SLURM_CONF=DIR/slurm.conf          # printed by `start`; sbatch, srun, squeue read it
#   deploy/slurm/local-cluster.sh stop DIR
#
# Everything lives in DIR: slurm.conf, a fresh munge key and munged socket, slurmctld and slurmd state,
# pid files and logs (DIR/log/). Nothing under /etc is touched and nothing is installed; it needs
# Debian's slurm-wlm and munge (apt-get install slurm-wlm munge) and root (slurmd runs jobs as their
# user). Made to work in containers without systemd or writable cgroups: proctrack/linuxproc,
# task/none, no accounting. Each node declares max(real CPUs, --cpus) CPUs (default 4) with
# SlurmdParameters=config_overrides, so a learner and two rollout daemons fit on a 2-core machine.
# One node is named after this host; with --nodes N > 1 they are <host>-0 .. <host>-(N-1), one slurmd
# each (ports slurmd-port + i), all at 127.0.0.1 and sharing this machine's /dev/shm.
set -euo pipefail

die() { echo "local-cluster.sh: $*" >&2; exit 1; }
usage() { sed -n '4,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[[ $# -ge 2 ]] || usage
action=$1 dir=$2
shift 2
nodes=1 cpus=4 ctld_port=6817 slurmd_port=6818
while [[ $# -gt 0 ]]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --cpus) cpus=$2; shift 2 ;;
    --ctld-port) ctld_port=$2; shift 2 ;;
    --slurmd-port) slurmd_port=$2; shift 2 ;;
    *) usage ;;
  esac
done

# SIGTERM to the daemons of the given pid files at once, wait up to 10 s, then SIGKILL what is left.
stop_daemons() {
  local pids=() pidfile pid
  for pidfile in "$@"; do
    [[ -s $pidfile ]] && pids+=("$(<"$pidfile")")
    rm -f "$pidfile"
  done
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 100); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    (( alive )) || return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}

if [[ $action == stop ]]; then
  dir=$(cd "$dir" 2>/dev/null && pwd) || die "no cluster directory $2"
  stop_daemons "$dir"/run/slurmd-*.pid "$dir/run/slurmctld.pid"
  stop_daemons "$dir/run/munged.pid"
  exit 0
fi
[[ $action == start ]] || usage

for bin in munged mungekey slurmctld slurmd scontrol sinfo; do
  command -v "$bin" >/dev/null || [[ -x /usr/sbin/$bin ]] ||
    die "$bin not found; install Debian's packages: apt-get install slurm-wlm munge"
done
PATH=$PATH:/usr/sbin
[[ $(id -u) == 0 ]] || die "slurmd must run as root to start jobs; run this as root (or with sudo)"

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/run" "$dir/log"
chmod 0700 "$dir/munge"

host=$(hostname -s)
names=("$host")
if (( nodes > 1 )); then
  names=()
  for i in $(seq 0 $((nodes - 1))); do names+=("$host-$i"); done
fi
real_cpus=$(nproc --all)
(( cpus < real_cpus )) && cpus=$real_cpus
mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9 / '"$nodes"')}' /proc/meminfo)

{
  cat <<EOF
# Written by deploy/slurm/local-cluster.sh: ${#names[@]} node(s) on this machine.
ClusterName=offpolicy-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=600
InactiveLimit=0
EOF
  for i in "${!names[@]}"; do
    echo "NodeName=${names[i]} NodeAddr=127.0.0.1 Port=$((slurmd_port + i)) CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
} >"$dir/slurm.conf"

# Fresh key, private socket: this cluster never talks to another munged.
rm -f "$dir/munge/munge.key"
mungekey --create --keyfile="$dir/munge/munge.key" --force
chmod 0400 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
  --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" ||
  die "munged did not start; see $dir/log/munged.log"

export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF" || die "slurmctld did not start; see $dir/log/slurmctld.log"
for name in "${names[@]}"; do
  slurmd -f "$SLURM_CONF" -N "$name" || die "slurmd of $name did not start; see $dir/log/slurmd-$name.log"
done

for _ in $(seq 300); do
  if [[ $(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l) == "${#names[@]}" ]]; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.1
done
die "not every node of ${names[*]} came up: $(sinfo -h -N -o '%N %t' 2>&1 | tr '\n' ' '); see $dir/log/"
