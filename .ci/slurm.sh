#!/usr/bin/env bash
# A real one-node SLURM on this host for tests/launchers: `start`, `stop` or `status`.
#
# start   installs Debian's slurm-wlm and munge if `srun` is missing, writes /etc/slurm/slurm.conf
#         (one node: this host, CPUs = nproc), starts munged, slurmctld and slurmd, and waits until
#         the node is idle and `srun -N1 -n1 true` runs. Does nothing if the cluster is already up.
# stop    cancels every job, stops the daemons it started and waits for them to exit.
# status  says whether the cluster is up; exit 0 if the node is usable.
#
# Needs root or passwordless sudo. Without either, `start` says the SLURM tests will be skipped and
# exits 0, or 1 under CI=true. State, spool, logs and pid files live in $JUPYTER_SHARD_SLURM_DIR
# (default /tmp/slurm-for-jupyter_shard); the clients find the cluster through /etc/slurm/slurm.conf,
# so tests need no extra environment.
set -euo pipefail

DIR=${JUPYTER_SHARD_SLURM_DIR:-/tmp/slurm-for-jupyter_shard}
CONF=/etc/slurm/slurm.conf
MARK="# Written by jupyter_shard .ci/slurm.sh for the test suite; \`.ci/slurm.sh start\` rewrites it."
READY_TIMEOUT=60
MUNGE_PID=/run/munge/munged.pid

log() { echo "slurm: $*"; }
fail() {
    echo "slurm: error: $*" >&2
    exit 1
}

SUDO=()
have_privileges() {
    if [ "$(id -u)" -eq 0 ]; then
        SUDO=()
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        return 1
    fi
}

as_root() { "${SUDO[@]}" "$@"; }

as_munge() {
    if [ "$(id -u)" -eq 0 ]; then runuser -u munge -- "$@"; else sudo -n -u munge "$@"; fi
}

# 0 if process $1 exists and is not a zombie (a killed daemon waits for PID 1 to reap it).
alive() {
    local state
    state=$(sed -n 's/^State:[[:space:]]*\(.\).*/\1/p' "/proc/$1/status" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

# The pid in $1 if that process is alive and its command name is $2.
live_pid() {
    local file=$1 name=$2 pid
    [ -r "$file" ] || return 1
    pid=$(tr -dc '0-9' <"$file")
    [ -n "$pid" ] && alive "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 1
    echo "$pid"
}

munge_ok() { timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; }

node_state() { timeout 15 sinfo -h -N -o %T 2>/dev/null | head -n 1; }

# 0 when the node answers as usable (clients installed, munge and slurmctld reachable).
healthy() {
    command -v sinfo >/dev/null 2>&1 && munge_ok || return 1
    # Our own configuration with our slurmctld gone: down, without sinfo's ~10 s of retries.
    if grep -qxF "$MARK" "$CONF" 2>/dev/null && ! live_pid "$DIR/slurmctld.pid" slurmctld >/dev/null; then
        return 1
    fi
    case "$(node_state)" in
        idle | mixed | allocated) return 0 ;;
        *) return 1 ;;
    esac
}

install_packages() {
    command -v srun >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 && return 0
    local t0=$SECONDS apt_log
    apt_log=$(mktemp /tmp/slurm-for-jupyter_shard-apt.XXXXXX)
    log "installing slurm-wlm and munge with apt-get (output in $apt_log)"
    if ! { as_root apt-get update -q && as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q slurm-wlm munge; } >"$apt_log" 2>&1; then
        tail -n 20 "$apt_log" >&2
        fail "apt-get could not install slurm-wlm and munge (see $apt_log)"
    fi
    rm -f "$apt_log"
    log "installed $(srun --version) in $((SECONDS - t0)) s"
}

write_config() {
    local host cpus mem_mb
    host=$(hostname -s)
    cpus=$(nproc)
    # A little under the memory the kernel reports, so slurmd never finds less than configured.
    mem_mb=$(awk '/^MemTotal:/ { print int($2 / 1024 * 0.9) }' /proc/meminfo)
    if [ -e "$CONF" ] && ! grep -qxF "$MARK" "$CONF"; then
        fail "$CONF exists and was not written by this script; not overwriting it"
    fi
    as_root mkdir -p /etc/slurm
    as_root tee "$CONF" >/dev/null <<EOF
$MARK
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmUser=root
SchedulerType=sched/backfill
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmdSpoolDir=$DIR/spool
StateSaveLocation=$DIR/state
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    log "wrote $CONF: node $host, $cpus CPUs, partition debug"
}

start_munge() {
    munge_ok && return 0
    as_root mkdir -p /run/munge
    as_root chown munge:munge /run/munge
    as_root chmod 0755 /run/munge
    as_munge /usr/sbin/munged
    as_root cp "$MUNGE_PID" "$DIR/munged.pid"
    log "started munged (pid $(cat "$DIR/munged.pid"))"
}

wait_ready() {
    local deadline=$((SECONDS + READY_TIMEOUT)) state=""
    while [ "$SECONDS" -lt "$deadline" ]; do
        state=$(node_state || true)
        case "$state" in
            idle | mixed | allocated) break ;;
        esac
        sleep 1
    done
    case "$state" in
        idle | mixed | allocated) ;;
        *) fail "node not idle after ${READY_TIMEOUT} s (sinfo says '${state:-nothing}'); see $DIR/*.log" ;;
    esac
    timeout 30 srun -N1 -n1 true || fail "srun -N1 -n1 true failed; see $DIR/*.log"
}

cmd_start() {
    if healthy; then
        log "already running: node $(hostname -s) $(node_state) ($CONF)"
        return 0
    fi
    if ! have_privileges; then
        echo "slurm: neither root nor passwordless sudo: SLURM tests will be skipped (run .ci/slurm.sh start as root to enable them)"
        [ "${CI:-}" = true ] && exit 1
        exit 0
    fi
    install_packages
    cmd_stop quiet # what is left of a cluster that is not usable
    local t0=$SECONDS
    as_root rm -rf "$DIR/state" "$DIR/spool"
    as_root mkdir -p "$DIR/state" "$DIR/spool"
    as_root chmod 0755 "$DIR"
    write_config
    start_munge
    as_root /usr/sbin/slurmctld
    as_root /usr/sbin/slurmd
    wait_ready
    log "up in $((SECONDS - t0)) s: slurmctld pid $(cat "$DIR/slurmctld.pid"), slurmd pid $(cat "$DIR/slurmd.pid"), logs in $DIR"
}

# Sends TERM to the daemon named $2 from pid file $1, then KILL after 15 s.
stop_daemon() {
    local file=$1 name=$2 pid i
    pid=$(live_pid "$file" "$name") || return 0
    as_root kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
        alive "$pid" || break
        sleep 0.1
    done
    if alive "$pid"; then as_root kill -KILL "$pid" 2>/dev/null || true; fi
    as_root rm -f "$file"
    log "stopped $name (pid $pid)"
}

cmd_stop() {
    local quiet=${1:-} jobs i name running=""
    for name in slurmd slurmctld munged; do
        if live_pid "$DIR/$name.pid" "$name" >/dev/null; then running="$running $name"; fi
    done
    if [ -z "$running" ]; then
        [ -n "$quiet" ] || log "not running (no live daemon pid in $DIR)"
        return 0
    fi
    have_privileges || fail "stopping$running needs root or passwordless sudo"
    if live_pid "$DIR/slurmctld.pid" slurmctld >/dev/null && munge_ok; then
        jobs=$(timeout 15 squeue -h -o %i 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086  # one argument per job id
            as_root scancel $jobs || true
            for ((i = 0; i < 100; i++)); do
                [ -z "$(timeout 15 squeue -h -o %i 2>/dev/null)" ] && break
                sleep 0.1
            done
            log "cancelled jobs: $(echo "$jobs" | paste -sd ' ' -)"
        fi
    fi
    stop_daemon "$DIR/slurmd.pid" slurmd
    stop_daemon "$DIR/slurmctld.pid" slurmctld
    stop_daemon "$DIR/munged.pid" munged
}

cmd_status() {
    local name pid
    for name in munged slurmctld slurmd; do
        if pid=$(live_pid "$DIR/$name.pid" "$name"); then log "$name running (pid $pid)"; else log "$name not running"; fi
    done
    if healthy; then
        log "up: $(timeout 15 sinfo -h -N -o '%N %P %c CPUs %T')"
    else
        log "down"
        return 1
    fi
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *)
        echo "usage: $0 start|stop|status" >&2
        exit 2
        ;;
esac
