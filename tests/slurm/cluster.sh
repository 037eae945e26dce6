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
set -euo pipefail

DIR=${SLURM_TEST_DIR:-/tmp/twinkle-slurm-test}
PORT=${SLURM_TEST_PORT:-16817}
NODES=(n1 n2)
CPUS_PER_NODE=${SLURM_TEST_CPUS_PER_NODE:-2}
START_TIMEOUT=${SLURM_TEST_START_TIMEOUT:-60}  # seconds for the nodes to become idle
export SLURM_CONF="$DIR/slurm.conf"

say() { echo "[cluster] $*" >&2; }

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
    mkdir -p "$DIR"/{munge,state,log,run}
    chmod 755 "$DIR/munge"  # munged wants its socket directory searchable by all
    for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/$node"; done
    local node_lines="" index=0
    for node in "${NODES[@]}"; do
        index=$((index + 1))
        node_lines+="NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$(hostname) Port=$((PORT + index)) "
        node_lines+="CPUs=$CPUS_PER_NODE State=UNKNOWN"$'\n'
    done
    cat > "$SLURM_CONF" <<EOF
# Written by tests/slurm/cluster.sh: a one-host test cluster on 127.0.0.1.
ClusterName=twinkle-test
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays the start of a requeued job (default 120 s): keep the tests short.
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: track job processes by their parent pids, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# Look at pending jobs every 2 s (default 60): a requeued job starts as soon as it may.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust the CPUs written here: two nodes share the host's cores.
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=30
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
SlurmctldTimeout=60
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

# start_daemon NAME COMMAND...: run COMMAND in the foreground as a background child, pid in run/NAME.pid.
start_daemon() {
    local name=$1
    shift
    "$@" </dev/null >>"$DIR/log/$name.stdout" 2>&1 &
    echo $! > "$DIR/run/$name.child"
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND until it succeeds
    local seconds=$1 what=$2
    shift 2
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        if (( SECONDS >= deadline )); then
            say "timed out after ${seconds}s waiting for $what"
            return 1
        fi
        sleep 0.5
    done
}

nodes_idle() {
    local states
    states=$(sinfo --noheader --Node --format='%N %t' 2>/dev/null) || return 1
    [[ $(grep -c ' idle$' <<<"$states") == "${#NODES[@]}" ]]
}

start() {
    if [[ -n $(running_children) ]]; then
        say "already running (pids $(running_children)); stop it first"
        exit 1
    fi
    mkdir -p "$DIR"
    install_packages
    rm -rf "$DIR"/{state,spool,log,run}
    write_config
    # Stop what was started if anything below fails.
    trap 'say "start failed; stopping what was started"; stop_daemons' ERR
    if [[ ! -s $DIR/munge/munge.key ]]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$DIR/munge/munge.key"
    fi
    start_daemon munged munged --foreground --force --key-file="$DIR/munge/munge.key" \
        --socket="$DIR/munge/munge.socket" --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed"
    wait_for 20 munged test -S "$DIR/munge/munge.socket"
    start_daemon slurmctld slurmctld -D -f "$SLURM_CONF"
    wait_for 30 slurmctld scontrol ping
    for node in "${NODES[@]}"; do
        start_daemon "slurmd-$node" slurmd -D -f "$SLURM_CONF" -N "$node"
    done
    wait_for "$START_TIMEOUT" "nodes ${NODES[*]} to be idle" nodes_idle
    trap - ERR
    say "up: $(sinfo --noheader --Node --format='%N:%t:%c' | tr '\n' ' ')(SLURM_CONF=$SLURM_CONF)"
}

running_children() {
    local pid_file pid pids=()
    for pid_file in "$DIR"/run/*.child; do
        [[ -e $pid_file ]] || continue
        pid=$(<"$pid_file")
        if kill -0 "$pid" 2>/dev/null; then pids+=("$pid"); fi
    done
    echo "${pids[*]}"
}

stop_daemons() {
    # The slurmd first (their job steps end with them), then slurmctld, then munged.
    local name pid_file pid
    for name in slurmd-n2 slurmd-n1 slurmctld munged; do
        pid_file="$DIR/run/$name.child"
        [[ -e $pid_file ]] || continue
        pid=$(<"$pid_file")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            local deadline=$((SECONDS + 20))
            while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.2; done
            if kill -0 "$pid" 2>/dev/null; then
                say "$name (pid $pid) ignored TERM for 20s: KILL"
                kill -KILL "$pid" 2>/dev/null || true
            fi
        fi
        rm -f "$pid_file"
    done
}

stop() {
    if [[ -z $(running_children) ]]; then
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
    left=$(running_children)
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
