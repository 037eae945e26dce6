#!/usr/bin/env bash
# A real two-host Slurm cluster on this machine, for the tests: tests/slurm/multinode.sh COMMAND
#
#   start              installs Slurm and munge when missing (tests/slurm/cluster.sh install), then creates
#                      three network namespaces: the hub ($PREFIX-hub: a bridge holding the controller's
#                      address) and two hosts ($PREFIX-mn1, $PREFIX-mn2), each with one veth "eth0" into the
#                      hub's bridge, created inside the namespaces (the root namespace gets no interface).
#                      Starts munged (root namespace: its socket is a file every namespace reaches),
#                      slurmctld in the hub and one slurmd per host, each daemon in its own UTS namespace
#                      (its own hostname: mnctl, mn1, mn2) and mount namespace (a hosts file naming the
#                      three bind-mounted on /etc/hosts), and waits until both nodes are idle.
#   stop               cancels every job, stops the daemons by their recorded pids (TERM, KILL after 20 s),
#                      ends what still runs in the namespaces, deletes the namespaces (and with them every
#                      interface), then runs `check-clean`. Safe whatever state the cluster is in.
#   check-clean        exit status 1, naming it, if a daemon, namespace or interface of the cluster is left.
#   in-hub CMD...      run CMD in the hub's network namespace (Slurm's clients reach the controller there).
#   lose-node NODE     the host vanishes: its cable is cut (its veth's hub end down, so no packet, not even
#                      a reset of its TCP connections, reaches anyone), then every process in its namespace
#                      (slurmd, job steps, tasks) is killed.
#   restore-node NODE  the host comes back: the cable is plugged in and its slurmd started again.
#
# Why these Slurm options (Debian's slurm-wlm 22.05 build, no systemd, inside a container): the comments of
# the slurm.conf both test clusters share (slurm_conf in tests/slurm/slurm_common.sh). Here besides:
#   daemons entered with `nsenter --net` (+ `unshare --uts --mount`), never `ip netns exec`: that remounts /sys,
#     and slurmd 22.05 then fails to initialise its cgroup plugin (it loads it even with ProctrackType=
#     proctrack/linuxproc and TaskPlugin=task/none).
#   SlurmdTimeout=$NODE_TIMEOUT: a lost host is declared down, and its jobs requeued, within seconds.
#
# Addresses: $SUBNET.1 (hub), $SUBNET.11 (mn1), $SUBNET.12 (mn2), on the test's own interfaces only, inside
# its own namespaces; nothing is routed anywhere else. Files: $SLURM_MN_DIR (default
# /tmp/twinkle-slurm-multinode): configuration, hosts file, munge key and socket, state, spool, logs, pids.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${SLURM_MN_DIR:-/tmp/twinkle-slurm-multinode}
PREFIX=${SLURM_MN_PREFIX:-twmn}
SUBNET=${SLURM_MN_SUBNET:-10.231.7}
CPUS_PER_NODE=${SLURM_MN_CPUS_PER_NODE:-4}
NODE_TIMEOUT=${SLURM_MN_NODE_TIMEOUT:-10}
START_TIMEOUT=${SLURM_MN_START_TIMEOUT:-60}
NODES=(mn1 mn2)
CONTROLLER=mnctl
HUB=$PREFIX-hub
export SLURM_CONF="$DIR/slurm.conf"

say() { echo "[multinode] $*" >&2; }
netns() { echo "$PREFIX-$1"; }              # the namespace of a host
address() { echo "$SUBNET.$((10 + ${1#mn}))"; }  # mn1 -> SUBNET.11
in_hub() { nsenter --net="/run/netns/$HUB" "$@"; }
# shellcheck source=tests/slurm/slurm_common.sh
source "$HERE/slurm_common.sh"

write_config() {
    make_dirs "${NODES[@]}"
    {
        echo "127.0.0.1 localhost"
        echo "$SUBNET.1 $CONTROLLER"
        for node in "${NODES[@]}"; do echo "$(address "$node") $node"; done
    } > "$DIR/hosts"
    local node_lines=""
    for node in "${NODES[@]}"; do
        node_lines+="NodeName=$node NodeAddr=$(address "$node") NodeHostname=$node CPUs=$CPUS_PER_NODE State=UNKNOWN"$'\n'
    done
    {
        echo "# Written by tests/slurm/multinode.sh: two hosts in network namespaces, the controller in a third."
        slurm_conf twinkle-multinode "$CONTROLLER($SUBNET.1)" "" "$NODE_TIMEOUT" "$node_lines"
    } > "$SLURM_CONF"
}

make_network() {
    ip netns add "$HUB"
    ip -n "$HUB" link set lo up
    ip -n "$HUB" link add br0 type bridge
    ip -n "$HUB" addr add "$SUBNET.1/24" dev br0
    ip -n "$HUB" link set br0 up
    for node in "${NODES[@]}"; do
        local ns
        ns=$(netns "$node")
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # Both ends are created inside namespaces: the hub's end (port-NODE) and the host's (eth0).
        ip -n "$HUB" link add "port-$node" type veth peer name eth0 netns "$ns"
        ip -n "$HUB" link set "port-$node" master br0 up
        ip -n "$ns" addr add "$(address "$node")/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
}

# start_in NAME NETNS HOSTNAME COMMAND...: COMMAND in the network namespace NETNS, with its own hostname and
# the cluster's hosts file (private UTS and mount namespaces), as a background child; its pid in run/NAME.child.
# nsenter, unshare and sh all exec: the recorded pid is the daemon's.
start_in() {
    local name=$1 ns=$2 host=$3
    shift 3
    nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
        sh -c 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"' "$host" "$DIR/hosts" "$@" \
        </dev/null >>"$DIR/log/$name.stdout" 2>&1 &
    echo $! > "$DIR/run/$name.child"
}

start_slurmd() { start_in "slurmd-$1" "$(netns "$1")" "$1" slurmd -D -f "$SLURM_CONF"; }

nodes_idle() {
    local states
    states=$(in_hub sinfo --noheader --Node --format='%N %t' 2>/dev/null) || return 1
    [[ $(grep -c ' idle$' <<<"$states") == "${#NODES[@]}" ]]
}

node_up() {  # the node is allocatable again (idle or running a job), not down
    local state
    state=$(in_hub sinfo --noheader --Node --nodes="$1" --format='%t' 2>/dev/null) || return 1
    [[ $state =~ ^(idle|mix|alloc)$ ]]
}

start() {
    if (( EUID != 0 )); then say "needs root (network namespaces, Slurm daemons)"; exit 1; fi
    if [[ -n $(leftovers) ]]; then
        say "a previous cluster is left ($(leftovers)); stopping it first"
        stop
    fi
    SLURM_TEST_DIR="$DIR" bash "$HERE/cluster.sh" install
    rm -rf "$DIR"/{state,spool,log,run}
    write_config
    trap 'say "start failed; tearing down"; stop' ERR
    make_network
    start_munged  # in the root namespace: its socket is a file every namespace reaches
    start_in slurmctld "$HUB" "$CONTROLLER" slurmctld -D -f "$SLURM_CONF"
    wait_for 30 slurmctld in_hub scontrol ping
    for node in "${NODES[@]}"; do start_slurmd "$node"; done
    wait_for "$START_TIMEOUT" "nodes ${NODES[*]} to be idle" nodes_idle
    trap - ERR
    say "up: $(in_hub sinfo --noheader --Node --format='%N:%t:%c' | tr '\n' ' ')(SLURM_CONF=$SLURM_CONF)"
}

our_namespaces() {
    local ns
    for ns in "$HUB" $(for node in "${NODES[@]}"; do netns "$node"; done); do
        if [[ -e /run/netns/$ns ]]; then echo "$ns"; fi
    done
}

leftovers() {  # what of the cluster still exists, in words (empty: nothing)
    local found=() children namespaces
    children=$(alive_children)
    if [[ -n $children ]]; then found+=("daemons $children"); fi
    namespaces=$(our_namespaces | tr '\n' ' ')
    if [[ -n ${namespaces// /} ]]; then found+=("namespaces $namespaces"); fi
    # No interface was ever made in the root namespace; check it stayed so.
    local interfaces
    interfaces=$(ip -o link show | awk -F': ' '{print $2}' | grep -E '^(port-mn[0-9]|br0)(@|$)' || true)
    if [[ -n $interfaces ]]; then found+=("root-namespace interfaces $interfaces"); fi
    echo "${found[*]}"
}

stop() {
    trap - ERR
    if [[ -e /run/netns/$HUB ]] && in_hub scontrol ping >/dev/null 2>&1; then
        in_hub scancel --quiet --user=root 2>/dev/null || true
        local deadline=$((SECONDS + 45))
        while [[ -n $(in_hub squeue --noheader --states=RUNNING,COMPLETING,CONFIGURING --format=%i 2>/dev/null) ]] &&
              (( SECONDS < deadline )); do
            sleep 0.5
        done
    fi
    local name pid_file
    for name in "${NODES[@]/#/slurmd-}" slurmctld munged; do
        pid_file="$DIR/run/$name.child"
        [[ -e $pid_file ]] || continue
        stop_pid "$name" "$(<"$pid_file")"
        rm -f "$pid_file"
    done
    # Whatever still runs in a namespace was started by this cluster (job steps, tasks): end it by pid.
    local ns
    for ns in $(our_namespaces); do
        if [[ -n $(ip netns pids "$ns" 2>/dev/null) ]]; then
            say "ending what is left in $ns: $(ip netns pids "$ns" | tr '\n' ' ')"
        fi
        kill_all_in "$ns" 30 || true
        ip netns del "$ns" 2>/dev/null || say "could not delete namespace $ns"
    done
    check_clean
    say "stopped"
}

check_clean() {
    local left
    left=$(leftovers)
    if [[ -n $left ]]; then
        say "left behind: $left"
        return 1
    fi
}

kill_all_in() {  # kill_all_in NAMESPACE SECONDS: KILL every process in it, again until none is left
    local ns=$1 deadline=$((SECONDS + $2)) pids
    while pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ') && [[ -n ${pids// /} ]]; do
        if (( SECONDS >= deadline )); then
            say "still in $ns after ${2}s: $pids ($(ps -o pid=,stat=,comm= -p "${pids// /,}" | tr '\n' ';'))"
            return 1
        fi
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        sleep 0.2
    done
}

lose_node() {
    local node=$1 ns
    ns=$(netns "$node")
    ip -n "$HUB" link set "port-$node" down
    say "$node lost: cable cut, killing $(ip netns pids "$ns" | tr '\n' ' ')"
    kill_all_in "$ns" 30
}

restore_node() {
    local node=$1
    ip -n "$HUB" link set "port-$node" up
    start_slurmd "$node"
    wait_for "$START_TIMEOUT" "$node to be back" node_up "$node"
    say "$node back: $(in_hub sinfo --noheader --Node --nodes="$node" --format='%N:%t')"
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    check-clean) check_clean ;;
    in-hub) shift; in_hub "$@" ;;
    lose-node) lose_node "${2:?node}" ;;
    restore-node) restore_node "${2:?node}" ;;
    status) in_hub sinfo; in_hub squeue ;;
    *) echo "usage: $0 start|stop|check-clean|status|in-hub CMD...|lose-node NODE|restore-node NODE" >&2; exit 2 ;;
esac
