#!/usr/bin/env bash
# A real one-host Slurm cluster for the tests: tests/slurm/cluster.sh start|stop|status
#
#   start   installs Debian's slurmctld, slurmd, slurm-client and munge when missing (root,
#           apt), writes a minimal slurm.conf on 127.0.0.1 with two CPU-only nodes n1 and n2,
#           each backed by its own slurmd (Debian builds Slurm with --enable-multiple-slurmd,
#           so several slurmd run on one host, each with its own -N name and port), starts
#           munged, slurmctld and the two slurmd in the foreground as background children,
#           records their pids, and waits until `sinfo` shows both nodes idle.
#   stop    cancels every job, waits for the job steps to end, then stops the daemons by
#           their recorded pids (TERM, then KILL after a grace period) and checks that none
#           is left. Safe to call when nothing runs.
#   status  prints sinfo and squeue.
#   install only installs the packages when missing (tests/slurm/multinode.sh uses it).
#
# Everything lives in $SLURM_TEST_DIR (default /tmp/twinkle-slurm-test): configuration, munge
# key and socket, state, spool, logs, pid files. Clients find the cluster through
#   export SLURM_CONF=$SLURM_TEST_DIR/slurm.conf
# Every wait is bounded; the ports are $SLURM_TEST_PORT (slurmctld) and the next two (slurmd).
# What it shares with tests/slurm/multinode.sh (most of slurm.conf, munged, waits): tests/slurm/slurm_common.sh.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${SLURM_TEST_DIR:-/tmp/twinkle-slurm-test}
PORT=${SLURM_TEST_PORT:-16817}
NODES=(n1 n2)
CPUS_PER_NODE=${SLURM_TEST_CPUS_PER_NODE:-2}
START_TIMEOUT=${SLURM_TEST_START_TIMEOUT:-60}  # seconds for the nodes to become idle
export SLURM_CONF="$DIR/slurm.conf"

say() { echo "[cluster] $*" >&2; }
# shellcheck source=tests/slurm/slurm_common.sh
source "$HERE/slurm_common.sh"

install_packages() {
    local missing=()
    for tool in munged slurmctld slurmd sbatch; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    if (( ${#missing[@]} == 0 )); then return; fi
    if (( EUID != 0 )); then
        say "missing ${missing[*]}; installing Slurm needs root (apt-get install slurmctld slurmd slurm-client munge)"
        exit 1
    fi
    say "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
    # The packages' maintainer scripts would start system daemons (munge, slurmd) of their
    # own: forbid that while installing, so that the only daemons are the ones started here.
    local policy=/usr/sbin/policy-rc.d own_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy"
        chmod 755 "$policy"
        own_policy=1
    fi
    local status=0
    timeout 600 apt-get update -qq || status=$?
    if (( status == 0 )); then
        DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq --no-install-recommends \
            slurmctld slurmd slurm-client munge >"$DIR/apt.log" 2>&1 || status=$?
    fi
    if (( own_policy )); then rm -f "$policy"; fi
    if (( status != 0 )); then
        say "apt-get failed (status $status); see $DIR/apt.log"
        tail -20 "$DIR/apt.log" >&2 || true
        exit 1
    fi
}

write_config() {
    make_dirs "${NODES[@]}"
    local node_lines="" index=0
    for node in "${NODES[@]}"; do
        index=$((index + 1))
        node_lines+="NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$(hostname) Port=$((PORT + index)) "
        node_lines+="CPUs=$CPUS_PER_NODE State=UNKNOWN"$'\n'
    done
    {
        echo "# Written by tests/slurm/cluster.sh: a one-host test cluster on 127.0.0.1."
        slurm_conf twinkle-test "$(hostname)(127.0.0.1)" "$PORT" 60 "$node_lines"
    } > "$SLURM_CONF"
}

# start_daemon NAME COMMAND...: run COMMAND in the foreground as a background child, pid in run/NAME.pid.
start_daemon() {
    local name=$1
    shift
    "$@" </dev/null >>"$DIR/log/$name.stdout" 2>&1 &
    echo $! > "$DIR/run/$name.child"
}

nodes_idle() {
    local states
    states=$(sinfo --noheader --Node --format='%N %t' 2>/dev/null) || return 1
    [[ $(grep -c ' idle$' <<<"$states") == "${#NODES[@]}" ]]
}

start() {
    if [[ -n $(alive_children) ]]; then
        say "already running (pids $(alive_children)); stop it first"
        exit 1
    fi
    mkdir -p "$DIR"
    install_packages
    rm -rf "$DIR"/{state,spool,log,run}
    write_config
    # Stop what was started if anything below fails.
    trap 'say "start failed; stopping what was started"; stop_daemons' ERR
    start_munged
    start_daemon slurmctld slurmctld -D -f "$SLURM_CONF"
    wait_for 30 slurmctld scontrol ping
    for node in "${NODES[@]}"; do
        start_daemon "slurmd-$node" slurmd -D -f "$SLURM_CONF" -N "$node"
    done
    wait_for "$START_TIMEOUT" "nodes ${NODES[*]} to be idle" nodes_idle
    trap - ERR
    say "up: $(sinfo --noheader --Node --format='%N:%t:%c' | tr '\n' ' ')(SLURM_CONF=$SLURM_CONF)"
}

stop_daemons() {
    # The slurmd first (their job steps end with them), then slurmctld, then munged.
    local name pid_file
    for name in slurmd-n2 slurmd-n1 slurmctld munged; do
        pid_file="$DIR/run/$name.child"
        [[ -e $pid_file ]] || continue
        stop_pid "$name" "$(<"$pid_file")"
        rm -f "$pid_file"
    done
}

stop() {
    if [[ -z $(alive_children) ]]; then
        say "not running"
        return 0
    fi
    if scontrol ping >/dev/null 2>&1; then
        scancel --full --quiet --signal=KILL --state=RUNNING --user=root 2>/dev/null || true
        scancel --quiet --user=root 2>/dev/null || true
        local deadline=$((SECONDS + 60))
        while [[ -n $(squeue --noheader --states=all --format=%i 2>/dev/null | grep -v '^$' || true) ]] &&
              [[ -n $(squeue --noheader --states=RUNNING,COMPLETING,CONFIGURING --format=%i 2>/dev/null) ]] &&
              (( SECONDS < deadline )); do
            sleep 0.5
        done
    fi
    stop_daemons
    local left
    left=$(alive_children)
    if [[ -n $left ]]; then
        say "still running: $left"
        exit 1
    fi
    say "stopped"
}

case ${1:-} in
    install) mkdir -p "$DIR"; install_packages ;;
    start) start ;;
    stop) stop ;;
    status) sinfo; squeue ;;
    *) echo "usage: $0 start|stop|status|install" >&2; exit 2 ;;
esac
