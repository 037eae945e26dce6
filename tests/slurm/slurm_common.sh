# What the two test clusters share (sourced by tests/slurm/cluster.sh and tests/slurm/multinode.sh, never run):
# the common part of their slurm.conf, munged, bounded waits and stopping a daemon by its pid.
# Each script defines `say` (its log prefix) and DIR (where its files live) before calling these.

# slurm_conf CLUSTER_NAME CONTROLLER PORT SLURMD_TIMEOUT NODE_LINES: print a test cluster's slurm.conf (after the
# caller's header comment). CONTROLLER is SlurmctldHost's value, HOST(ADDRESS); PORT empty: Slurm's default
# (6817); SLURMD_TIMEOUT: how soon a lost node is declared down; NODE_LINES: the NodeName lines, one partition
# holds them all. Files live in $DIR. The comments in the file say why an option is set, for Debian's
# slurm-wlm 22.05 build, without systemd, inside a container.
slurm_conf() {
    local cluster=$1 controller=$2 port=$3 slurmd_timeout=$4 node_lines=$5
    echo "ClusterName=$cluster"
    echo "SlurmctldHost=$controller"
    if [[ -n $port ]]; then echo "SlurmctldPort=$port"; fi
    cat <<EOF
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays the start of a requeued job (default 120 s): with 5, a requeued job may start
# again 5 s after it ended, which keeps the tests short.
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container (no writable cgroup hierarchy, no cgroup.conf): track job processes by their
# parent pids, bind nothing to cores.
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
# Trust the CPUs written here: the nodes share the machine's cores.
SlurmdParameters=config_overrides
# A node that was down is usable again as soon as its slurmd registers.
ReturnToService=2
KillWait=30
MinJobAge=600
InactiveLimit=0
# How soon a node whose slurmd stopped answering is declared down and its jobs requeued.
SlurmdTimeout=$slurmd_timeout
SlurmctldTimeout=60
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

# make_dirs NODE...: the cluster's directories under $DIR, a spool directory per node.
make_dirs() {
    mkdir -p "$DIR"/{munge,state,log,run}
    chmod 755 "$DIR/munge"  # munged wants its socket directory searchable by all
    local node
    for node in "$@"; do mkdir -p "$DIR/spool/$node"; done
}

# start_munged: a munge key made once, munged in the foreground as a background child (its pid in
# run/munged.child; it runs in the caller's namespaces: its socket is a file every namespace reaches).
start_munged() {
    if [[ ! -s $DIR/munge/munge.key ]]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$DIR/munge/munge.key"
    fi
    munged --foreground --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
        </dev/null >>"$DIR/log/munged.stdout" 2>&1 &
    echo $! > "$DIR/run/munged.child"
    wait_for 20 munged test -S "$DIR/munge/munge.socket"
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

alive_children() {  # the pids recorded in run/*.child whose process still runs
    local pid_file pid pids=()
    for pid_file in "$DIR"/run/*.child; do
        [[ -e $pid_file ]] || continue
        pid=$(<"$pid_file")
        if kill -0 "$pid" 2>/dev/null; then pids+=("$pid"); fi
    done
    echo "${pids[*]}"
}

stop_pid() {  # stop_pid NAME PID: TERM, then KILL after 20 s
    local name=$1 pid=$2
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 20))
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
        say "$name (pid $pid) ignored TERM for 20s: KILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
}
