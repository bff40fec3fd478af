#!/usr/bin/env bash
# localcluster.sh - a real, throw-away Slurm cluster on localhost.
#
# Used by the test suite (tests/slurm/fixture.py) and by contributors who want a
# cluster to submit `pretrain` jobs to. Everything the cluster owns (configs,
# state, spool, logs, pid files, the munge socket and key, the MariaDB datadir
# and socket, fake GPU device files) lives under one directory DIR, so several
# clusters (or a system-wide Slurm/MariaDB/munge) can coexist on one machine as
# long as they use different ports (see "Ports" below).
#
# Usage:
#   localcluster.sh install          apt-get install the packages (no-op if present)
#   localcluster.sh start DIR        start a fresh cluster in DIR; on success the
#                                    only line on stdout is
#                                      export SLURM_CONF=DIR/etc/slurm.conf
#                                    so `eval "$(localcluster.sh start DIR)"` works.
#                                    Progress and errors go to stderr.
#   localcluster.sh stop DIR         cancel its jobs, stop exactly the daemons that
#                                    `start DIR` started (pid files in DIR/run)
#   localcluster.sh status DIR       show which of its daemons run, and sinfo;
#                                    exit status 3 if any of them is not running
#   localcluster.sh node-kill DIR N  kill node N at once (its slurmd, step daemons
#                                    and job processes), as a power cut would
#   localcluster.sh node-start DIR N start node N's slurmd again and wait until
#                                    slurmctld has it back in service
#
# The cluster: ClusterName=localcluster, two nodes n1 and n2 (two slurmd on this
# host, MULTIPLE_SLURMD), each CPUs=2 (task/affinity binds tasks to them), RealMemory=4000, 2 fake GPUs (gres gpu:2,
# character devices under DIR/dev), one partition `debug` (Default, no time
# limit), accounting through slurmdbd + MariaDB so `sacct` works, requeued jobs
# restart after about 10 s.
#
# `start` is idempotent: if the cluster in DIR is already up it only prints the
# export line. Otherwise it stops whatever is left of an earlier cluster in DIR,
# wipes its state (job ids restart at 1, node DRAIN states and the accounting
# database are gone) and starts from scratch. If a daemon fails to come up, the
# tail of its log is printed, the daemons started so far are stopped and the
# exit status is 1. All waits are bounded (LOCALCLUSTER_TIMEOUT seconds each).
#
# Ports (environment, defaults in brackets); node i's slurmd uses SLURMD_PORT+i-1:
#   LOCALCLUSTER_CTLD_PORT [16817]  LOCALCLUSTER_DBD_PORT [16819]
#   LOCALCLUSTER_SLURMD_PORT [17001]
# Other knobs: LOCALCLUSTER_TIMEOUT [60] (seconds per wait).
#
# The shape of the cluster (the defaults are the test suite's; a machine with
# real GPUs, such as the benchmark GPU machine, sets them as it has them):
#   LOCALCLUSTER_NODES [2]        slurmd nodes n1..nN on this host
#   LOCALCLUSTER_CPUS [2]         CPUs of each node
#   LOCALCLUSTER_MEM_MB [4000]    RealMemory of each node
#   LOCALCLUSTER_GPUS [fake]      fake: 2 stand-in GPUs a node (character devices
#                                 under DIR/dev); real: this host's /dev/nvidiaN
#                                 files, shared out among the nodes in order
#   LOCALCLUSTER_ACCOUNTING [slurmdbd]  slurmdbd: slurmdbd + MariaDB, so sacct
#                                 works; none: no accounting (sacct fails, squeue
#                                 and scontrol answer), for hosts without MariaDB
#
# Needs root (SlurmUser=root, mknod, and `127.0.0.1 n1 n2` is added to
# /etc/hosts because jobs resolve node names, e.g. for MASTER_ADDR) and the
# Debian/Ubuntu packages slurmctld slurmd slurm-client slurmdbd munge
# mariadb-server. No systemd needed: every daemon runs in its foreground mode in
# the background of this script, its output going to DIR/log.

set -euo pipefail
# Debian puts the daemons in /usr/sbin, which a non-login shell's PATH may lack.
export PATH=$PATH:/usr/sbin:/sbin

PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)
BINARIES=(munged munge unmunge slurmctld slurmd sinfo sbatch srun squeue scontrol sacct scancel)
ACCOUNTING_BINARIES=(mariadbd mariadb mariadb-install-db slurmdbd sacctmgr)
CLUSTER_NAME=localcluster

CTLD_PORT=${LOCALCLUSTER_CTLD_PORT:-16817}
DBD_PORT=${LOCALCLUSTER_DBD_PORT:-16819}
SLURMD_PORT=${LOCALCLUSTER_SLURMD_PORT:-17001}
TIMEOUT=${LOCALCLUSTER_TIMEOUT:-60}
NODE_COUNT=${LOCALCLUSTER_NODES:-2}
NODE_CPUS=${LOCALCLUSTER_CPUS:-2}
NODE_MEM_MB=${LOCALCLUSTER_MEM_MB:-4000}
GPUS=${LOCALCLUSTER_GPUS:-fake}
ACCOUNTING=${LOCALCLUSTER_ACCOUNTING:-slurmdbd}
[[ $NODE_COUNT =~ ^[1-9][0-9]*$ ]] || { echo "localcluster: error: LOCALCLUSTER_NODES=$NODE_COUNT: a count of nodes" >&2; exit 2; }
[[ $GPUS == fake || $GPUS == real ]] || { echo "localcluster: error: LOCALCLUSTER_GPUS=$GPUS: fake or real" >&2; exit 2; }
[[ $ACCOUNTING == slurmdbd || $ACCOUNTING == none ]] ||
    { echo "localcluster: error: LOCALCLUSTER_ACCOUNTING=$ACCOUNTING: slurmdbd or none" >&2; exit 2; }
NODES=()
for ((i = 1; i <= NODE_COUNT; i++)); do NODES+=("n$i"); done

log() { printf 'localcluster: %s\n' "$*" >&2; }
die() { printf 'localcluster: error: %s\n' "$*" >&2; exit 1; }

usage() {
    sed -n '/^# Usage:/,/^# The cluster:/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

# ---------------------------------------------------------------------------
# helpers

missing_binaries() {
    local b out=()
    local wanted=("${BINARIES[@]}")
    [[ $ACCOUNTING == none ]] || wanted+=("${ACCOUNTING_BINARIES[@]}")
    for b in "${wanted[@]}"; do
        command -v "$b" >/dev/null 2>&1 || out+=("$b")
    done
    echo "${out[*]}"
}

# Which daemons exist, in start order (stop goes the other way).
daemon_names() {
    if [[ $ACCOUNTING == none ]]; then
        echo munged slurmctld "${NODES[@]/#/slurmd-}"
    else
        echo munged mariadbd slurmdbd slurmctld "${NODES[@]/#/slurmd-}"
    fi
}

pid_of() { # name -> pid from DIR/run/NAME.pid, or nothing
    local f=$RUN/$1.pid
    if [[ -s $f ]]; then cat "$f"; fi
}

# True if PID is alive AND was started by us for this DIR: every daemon we start
# carries LOCALCLUSTER_DIR=$DIR in its environment, which guards against
# killing an unrelated process that reused the pid.
is_ours() {
    local pid=$1
    [[ -n $pid && -r /proc/$pid/environ ]] || return 1
    { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qxF "LOCALCLUSTER_DIR=$DIR"
}

alive() { is_ours "$(pid_of "$1")"; }

logfile_of() { echo "$LOGDIR/$1.log"; }

show_log() { # name [lines]
    local f
    f=$(logfile_of "$1")
    if [[ -s $f ]]; then
        printf -- '----- last %s lines of %s -----\n' "${2:-25}" "$f" >&2
        tail -n "${2:-25}" "$f" >&2
        printf -- '-----\n' >&2
    else
        printf -- '(%s is empty or missing)\n' "$f" >&2
    fi
}

# Fail during start: show the log of the culprit (and, once slurmctld runs,
# its log and the node states), stop what was started, exit 1.
start_failed() { # name message
    local name=$1; shift
    printf 'localcluster: error: %s\n' "$*" >&2
    show_log "$name" 40
    if [[ $name == slurmd-* ]] && alive slurmctld; then
        show_log slurmctld 15
        printf 'node states (sinfo):\n' >&2
        slurm sinfo -N -h -o '%N %T %E' >&2 || true
    fi
    log "stopping the daemons started so far (logs stay in $LOGDIR)"
    stop_daemons || true
    exit 1
}

# Start a daemon in the background (it must stay in the foreground itself),
# in directory WORKDIR, recording its pid. Output goes to DIR/log/NAME.log.
# slurmstepd (forked by slurmd) keeps slurmd's working directory but not its
# environment, which is how `stop` recognises leftover step daemons.
spawn() { # name workdir cmd...
    local name=$1 workdir=$2; shift 2
    (
        cd "$workdir"
        export LOCALCLUSTER_DIR=$DIR
        exec "$@"
    ) </dev/null >>"$(logfile_of "$name")" 2>&1 &
    local pid=$! i
    echo "$pid" >"$RUN/$name.pid"
    # Until the subshell has exec'd, /proc/PID/environ lacks the marker and
    # the daemon would look dead to `alive`.
    for ((i = 0; i < 100; i++)); do
        is_ours "$pid" || ! kill -0 "$pid" 2>/dev/null && break
        sleep 0.05
    done
}

# Poll CMD until it succeeds; give up after TIMEOUT seconds or as soon as one
# of the daemons NAMES (space-separated; the first is blamed on timeout) died.
wait_for() { # names description cmd...
    local names=$1 what=$2 name; shift 2
    local deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        for name in $names; do
            alive "$name" || start_failed "$name" "$name exited while waiting for: $what"
        done
        ((SECONDS < deadline)) || start_failed "${names%% *}" "timed out after ${TIMEOUT}s waiting for: $what"
        sleep 0.2
    done
    log "$(printf '%5.1fs' "$(elapsed)") ok: $what"
}

elapsed() { echo "${EPOCHREALTIME/[,.]*/}${EPOCHREALTIME#*[,.]} $T0" | awk '{ printf "%.1f", ($1 - $2) / 1e6 }'; }

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

slurm() { SLURM_CONF=$CONF "$@"; }

# ---------------------------------------------------------------------------
# install

# Of PACKAGES, those that dpkg has not set up completely (unpacked or half-configured); none where
# there is no dpkg.
unconfigured_packages() {
    command -v dpkg-query >/dev/null || return 0
    local p out=()
    for p in "${PACKAGES[@]}"; do
        [[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null) == ii* ]] || out+=("$p")
    done
    echo "${out[*]}"
}

# Package scripts decide whether a system user exists with `id -u NAME`. Versions of
# tests/test_singularity.py before 2026-12-03 overwrote /usr/bin/id through a symlink when run as
# root, with a stand-in that answers 1000 for every name; on such a machine munge and slurm were left
# half-configured, with no munge or slurm user. Put coreutils' id back, add the slurm user, then let
# the packages finish their set-up (munge's postinst adds its own user).
repair_package_setup() {
    if dpkg --verify coreutils 2>/dev/null | grep -q ' /usr/bin/id$'; then
        log "/usr/bin/id is not coreutils' own: reinstalling coreutils"
        # The reinstall succeeds even where apt then fails to configure the half-set-up packages.
        apt-get install -y -q --reinstall coreutils >&2 || true
        ! dpkg --verify coreutils 2>/dev/null | grep -q ' /usr/bin/id$' || die "could not restore /usr/bin/id"
    fi
    if ! getent passwd slurm >/dev/null && dpkg-query -W slurm-wlm-basic-plugins >/dev/null 2>&1; then
        # slurm-wlm-basic-plugins adds it in its preinst on a first install only, so a reinstall won't.
        log "no slurm user: adding it as slurm-wlm-basic-plugins' preinst does"
        adduser --quiet --system --group --uid 64030 --no-create-home --home /nonexistent slurm >&2
    fi
    dpkg --configure -a >&2 || die "dpkg --configure -a failed on: $(unconfigured_packages)"
}

cmd_install() {
    local missing unconfigured
    missing=$(missing_binaries)
    unconfigured=$(unconfigured_packages)
    if [[ -z $missing && -z $unconfigured ]]; then
        log "packages already installed"
        return 0
    fi
    local needs="${missing:+missing: $missing; }${unconfigured:+not completely set up: $unconfigured; }"
    [[ $EUID -eq 0 ]] || die "${needs}installing needs root (apt-get install ${PACKAGES[*]})"
    command -v apt-get >/dev/null || die "${needs}no apt-get here, install ${PACKAGES[*]} by hand"
    export DEBIAN_FRONTEND=noninteractive
    if [[ -n $unconfigured ]]; then
        log "not completely set up: $unconfigured; repairing"
        repair_package_setup
    fi
    log "installing ${PACKAGES[*]}"
    # Install from the existing package lists first; refresh them only if needed.
    if ! apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >&2; then
        apt-get update -q >&2 || die "apt-get update failed"
        apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >&2 || die "apt-get install failed"
    fi
    missing=$(missing_binaries)
    [[ -z $missing ]] || die "still missing after install: $missing"
    unconfigured=$(unconfigured_packages)
    [[ -z $unconfigured ]] || die "not completely set up after install: $unconfigured (see dpkg's messages above)"
}

# ---------------------------------------------------------------------------
# configuration

# The GPU device files of each node, one line per node in node order.
gpu_files_per_node() {
    local i n per files=()
    if [[ $GPUS == fake ]]; then
        # gres needs File= to point at something; character devices (same
        # numbers as /dev/null) keep slurmd quiet, regular files merely warn.
        for ((n = 0; n < NODE_COUNT; n++)); do
            for i in 0 1; do
                mknod "$DIR/dev/gpu$n$i" c 1 3 2>/dev/null || : >"$DIR/dev/gpu$n$i"
            done
            echo "$DIR/dev/gpu${n}0,$DIR/dev/gpu${n}1"
        done
        return
    fi
    mapfile -t files < <(find /dev -maxdepth 1 -regex '/dev/nvidia[0-9]+' | sort -V)
    ((${#files[@]})) || die "LOCALCLUSTER_GPUS=real: no /dev/nvidiaN files on this host"
    ((${#files[@]} % NODE_COUNT == 0)) || die "${#files[@]} GPUs do not divide among $NODE_COUNT nodes"
    per=$((${#files[@]} / NODE_COUNT))
    for ((n = 0; n < NODE_COUNT; n++)); do
        local IFS=,
        echo "${files[*]:$((n * per)):$per}"
    done
}

write_configs() {
    local host i files gpus
    host=$(hostname -s)
    mapfile -t files < <(gpu_files_per_node)
    gpus=$(awk -F, '{print NF; exit}' <<<"${files[0]}")

    cat >"$DIR/etc/slurm.conf" <<EOF
# Generated by localcluster.sh; throw-away test cluster on localhost.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# socket: our own munged; cred_expire: a requeued job may start again after
# this many seconds (default 120).
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10

StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.daemon.pid
SlurmdPidFile=$DIR/run/slurmd-%n.daemon.pid
# No SlurmctldLogFile/SlurmdLogFile: in -D mode the daemons log to stderr,
# which goes to DIR/log/NAME.log (a log file would get every line twice).
SlurmctldDebug=info
SlurmdDebug=info
TmpFS=$DIR/tmp
MailProg=/bin/true

ProctrackType=proctrack/linuxproc
# Tasks are bound to the CPUs their step was given, as on real clusters, so a test can see them.
TaskPlugin=task/affinity
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
# The node definitions below claim more than this host may have.
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
InactiveLimit=0
MinJobAge=300
SlurmdTimeout=30
GresTypes=gpu

$(accounting_lines)
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none

NodeName=n[1-$NODE_COUNT] NodeHostname=$host NodeAddr=127.0.0.1 Port=$SLURMD_PORT-$((SLURMD_PORT + NODE_COUNT - 1)) CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB Gres=gpu:$gpus State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODE_COUNT] Default=YES MaxTime=INFINITE State=UP
EOF

    {
        echo "AutoDetect=off"
        for ((i = 0; i < NODE_COUNT; i++)); do
            echo "NodeName=${NODES[i]} Name=gpu File=${files[i]}"
        done
    } >"$DIR/etc/gres.conf"

    {
        echo "CgroupPlugin=autodetect"
        # On cgroup v2 without systemd (a container, a VM like the benchmark GPU machine) slurmd
        # cannot ask systemd for its scope over D-Bus: it makes its cgroups itself.
        if [[ $(stat -fc %T /sys/fs/cgroup 2>/dev/null) == cgroup2fs && ! -d /run/systemd/system ]]; then
            echo "IgnoreSystemd=yes"
            echo "CgroupAutomount=yes"
            # Where systemd would have put its scope; slurmd enables its controllers there.
            mkdir -p /sys/fs/cgroup/system.slice
        fi
    } >"$DIR/etc/cgroup.conf"

    [[ $ACCOUNTING == none ]] && return 0
    DB_PASS=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')
    cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.daemon.pid
DebugLevel=info
StorageType=accounting_storage/mysql
# localhost: the unix socket given by MYSQL_UNIX_PORT (our own mariadbd).
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DIR/etc/slurmdbd.conf"
}

accounting_lines() {
    if [[ $ACCOUNTING == none ]]; then
        echo "AccountingStorageType=accounting_storage/none"
        return
    fi
    cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# With auth/munge this is the munge socket used to talk to slurmdbd (AuthInfo's
# socket= is not used for that); without it the default /run/munge is tried.
AccountingStoragePass=$DIR/munge/munge.socket
AccountingStorageTRES=gres/gpu
EOF
}

ensure_hosts_entry() {
    local n addr missing=()
    for n in "${NODES[@]}"; do
        if addr=$(getent hosts "$n"); then
            [[ $addr == 127.* ]] || log "warning: node name $n resolves to ${addr%% *}, not to this host"
        else
            missing+=("$n")
        fi
    done
    ((${#missing[@]} == 0)) && return 0
    [[ -w /etc/hosts ]] || die "node names ${missing[*]} do not resolve and /etc/hosts is not writable; add: 127.0.0.1 ${missing[*]}"
    printf '127.0.0.1 %s  # added by localcluster.sh\n' "${missing[*]}" >>/etc/hosts
    log "added '127.0.0.1 ${missing[*]}' to /etc/hosts"
}

# ---------------------------------------------------------------------------
# start

# shellcheck disable=SC2120  # called with arguments through wait_for
sql() { mariadb --no-defaults -S "$DIR/mysql/mysqld.sock" -u root "$@"; }

munge_works() {
    munge -n -S "$DIR/munge/munge.socket" | unmunge -S "$DIR/munge/munge.socket"
}

slurmctld_up() { slurm scontrol ping | grep -q 'is UP'; }

nodes_idle() { # all nodes idle, as seen by slurmctld
    local states
    states=$(slurm sinfo -h -N -o '%N %T' | sort -u)
    [[ $(grep -c ' idle$' <<<"$states") -eq ${#NODES[@]} ]]
}

accounting_works() {
    slurm sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER_NAME" &&
        slurm sacct -n -X -a >/dev/null
}

cmd_start() {
    local missing p name
    T0=${EPOCHREALTIME/[,.]*/}${EPOCHREALTIME#*[,.]}
    missing=$(missing_binaries)
    [[ -z $missing ]] || die "missing programs: $missing (run: $0 install)"
    [[ $EUID -eq 0 ]] || die "must run as root (SlurmUser=root, mknod, /etc/hosts)"

    if [[ -s $CONF ]]; then
        local all=1
        for name in $(daemon_names); do alive "$name" || all=0; done
        if ((all)) && nodes_idle_or_busy; then
            log "already running in $DIR"
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
    fi
    if [[ -d $RUN ]]; then
        for name in $(daemon_names); do
            if alive "$name"; then
                log "stopping what is left of the earlier cluster in $DIR"
                stop_daemons
                break
            fi
        done
    fi

    local ports=("$CTLD_PORT")
    [[ $ACCOUNTING == none ]] || ports+=("$DBD_PORT")
    for ((p = 0; p < NODE_COUNT; p++)); do ports+=("$((SLURMD_PORT + p))"); done
    for p in "${ports[@]}"; do
        ! port_in_use "$p" || die "port $p on 127.0.0.1 is in use (another cluster?); pick others with LOCALCLUSTER_CTLD_PORT / LOCALCLUSTER_DBD_PORT / LOCALCLUSTER_SLURMD_PORT"
    done

    rm -rf "${DIR:?}"/{etc,run,log,state,spool,munge,mysql,dev,tmp}
    mkdir -p "$DIR"/{etc,run,log,state,dev,tmp,mysql} "${NODES[@]/#/$DIR/spool/}"
    install -d -m 0755 "$DIR/munge"   # munged refuses group/other-writable dirs
    ensure_hosts_entry
    write_configs

    # munge, with its own key and socket.
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$DIR/munge/munge.key"
    # -f: start even if munged finds a stale socket or dislikes a directory's
    # permissions (e.g. a DIR under a group-writable path).
    spawn munged "$RUN" munged -F -f --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/run/munged.daemon.pid" --seed-file="$DIR/munge/munged.seed"
    wait_for munged "munge credentials to round-trip" munge_works
    [[ $ACCOUNTING == none ]] || start_accounting

    spawn slurmctld "$RUN" env SLURM_CONF="$CONF" slurmctld -D -i -f "$CONF"
    wait_for slurmctld "slurmctld to answer 'scontrol ping'" slurmctld_up

    for name in "${NODES[@]}"; do
        spawn "slurmd-$name" "$DIR/spool/$name" env SLURM_CONF="$CONF" slurmd -D -N "$name" -f "$CONF"
    done
    wait_for "${NODES[*]/#/slurmd-} slurmctld" "nodes ${NODES[*]} to be idle in sinfo" nodes_idle
    if [[ $ACCOUNTING != none ]]; then
        wait_for slurmctld "the cluster to be registered in accounting (sacctmgr/sacct)" accounting_works
    fi
    for name in $(daemon_names); do
        alive "$name" || start_failed "$name" "$name exited during start-up"
    done

    log "cluster up in $(elapsed)s: $(slurm sinfo -h -o '%P %D %T %N' | tr '\n' ' ')"
    echo "export SLURM_CONF=$CONF"
}

# MariaDB and slurmdbd, so that sacct works.
start_accounting() {
    # MariaDB: own datadir and socket, no TCP, run as root so DIR may be private.
    mariadb-install-db --no-defaults --user=root --datadir="$DIR/mysql/data" \
        --auth-root-authentication-method=socket --skip-test-db >"$LOGDIR/mariadb-install-db.log" 2>&1 ||
        { log "mariadb-install-db failed"; show_log mariadb-install-db 40; stop_daemons; exit 1; }
    spawn mariadbd "$RUN" mariadbd --no-defaults --user=root --datadir="$DIR/mysql/data" \
        --socket="$DIR/mysql/mysqld.sock" --skip-networking --pid-file="$DIR/run/mariadbd.daemon.pid" \
        --skip-log-bin --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
        --innodb-flush-log-at-trx-commit=0
    wait_for mariadbd "MariaDB to accept connections" sql -e 'SELECT 1'
    # shellcheck disable=SC2119
    sql <<EOF || start_failed mariadbd "could not create the accounting database"
DROP DATABASE IF EXISTS slurm_acct_db;
CREATE DATABASE slurm_acct_db;
CREATE USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF

    # slurmdbd finds our MariaDB through MYSQL_UNIX_PORT (StorageHost=localhost).
    spawn slurmdbd "$RUN" env SLURM_CONF="$CONF" MYSQL_UNIX_PORT="$DIR/mysql/mysqld.sock" slurmdbd -D
    wait_for slurmdbd "slurmdbd to listen on port $DBD_PORT" port_in_use "$DBD_PORT"
}

nodes_idle_or_busy() { # used for the "already running" check: nodes answer
    local states
    states=$(slurm sinfo -h -N -o '%T' 2>/dev/null) || return 1
    ! grep -qiE 'down|drain|fail|unknown|not_responding|inval' <<<"$states" && [[ -n $states ]]
}

# ---------------------------------------------------------------------------
# stop

# Leftover slurmstepd processes of this cluster: their working directory is
# the spool directory of the slurmd that forked them.
stray_stepds() {
    local p cwd
    for p in $(pgrep -x slurmstepd || true); do
        cwd=$(readlink "/proc/$p/cwd" 2>/dev/null) || continue
        [[ $cwd == "$DIR/"* ]] && echo "$p"
    done
    return 0
}

# PIDS and all their descendants.
with_descendants() {
    ps -e -o pid=,ppid= | awk -v roots="$*" '
        BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
        { parent[$1] = $2; pids[++m] = $1 }
        END {
            do { changed = 0
                 for (i = 1; i <= m; i++) if (!(pids[i] in keep) && (parent[pids[i]] in keep)) { keep[pids[i]] = 1; changed = 1 }
            } while (changed)
            for (p in keep) print p
        }'
}

terminate() { # name pid: SIGTERM, bounded wait, SIGKILL
    local name=$1 pid=$2 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < 100; i++)); do   # 20 s
        is_ours "$pid" || return 0
        [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) == Z ]] && return 0
        sleep 0.2
    done
    log "$name (pid $pid) ignored SIGTERM for 20s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

stop_daemons() {
    local names name pid i left
    [[ -d $RUN ]] || return 0
    # Cancel jobs first so that slurmstepd and the jobs' processes go away too.
    if alive slurmctld && [[ -s $CONF ]]; then
        local jobs=()
        mapfile -t jobs < <(slurm squeue -h -o %i 2>/dev/null)
        if ((${#jobs[@]})); then
            slurm scancel --quiet "${jobs[@]}" 2>/dev/null || true
            for ((i = 0; i < 75; i++)); do   # KillWait=5 plus slack
                [[ -z $(slurm squeue -h -t running,completing -o %i 2>/dev/null) ]] && break
                sleep 0.2
            done
        fi
    fi
    read -r -a names <<<"$(daemon_names)"
    for ((i = ${#names[@]} - 1; i >= 0; i--)); do
        name=${names[i]}
        pid=$(pid_of "$name")
        if is_ours "$pid"; then
            terminate "$name" "$pid"
        fi
        rm -f "$RUN/$name.pid"
    done
    # Job step daemons of this cluster still alive (jobs could not be
    # cancelled, e.g. slurmctld was gone), with the job processes under them.
    left=$(stray_stepds)
    if [[ -n $left ]]; then
        for pid in $(with_descendants "$left"); do
            log "killing leftover job process $pid: $({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null)"
            kill -KILL "$pid" 2>/dev/null || true
        done
    fi
    # Reap our own background children, if this shell started them.
    wait 2>/dev/null || true
}

cmd_stop() {
    [[ -d $DIR ]] || { log "nothing to stop in $DIR"; return 0; }
    stop_daemons
    log "stopped cluster in $DIR"
}

cmd_status() {
    local name pid rc=0
    for name in $(daemon_names); do
        pid=$(pid_of "$name")
        if is_ours "$pid"; then
            printf '%-12s running (pid %s)\n' "$name" "$pid"
        else
            printf '%-12s not running\n' "$name"
            rc=3
        fi
    done
    if alive slurmctld; then slurm sinfo -N -l || true; fi
    return $rc
}

# ---------------------------------------------------------------------------
# one node: a power cut, and the node coming back

# Every process of node NAME at once (SIGKILL): its slurmd, its step daemons and
# the job processes under them, as when a node loses power.
cmd_node_kill() {
    local name=$NODE pid cwd roots=()
    pid=$(pid_of "slurmd-$name")
    is_ours "$pid" && roots+=("$pid")
    for pid in $(pgrep -x slurmstepd || true); do
        cwd=$(readlink "/proc/$pid/cwd" 2>/dev/null) || continue
        [[ $cwd == "$DIR/spool/$name" ]] && roots+=("$pid")
    done
    ((${#roots[@]})) || die "nothing of node $name is running"
    # Stop them first so that none forks or reports while the others die.
    for pid in $(with_descendants "${roots[*]}"); do kill -STOP "$pid" 2>/dev/null || true; done
    for pid in $(with_descendants "${roots[*]}"); do kill -KILL "$pid" 2>/dev/null || true; done
    rm -f "$RUN/slurmd-$name.pid"
    log "node $name killed (slurmd and ${#roots[@]} daemons with their processes)"
}

node_up() { # slurmctld sees node NAME answering again
    slurm scontrol show node "$NODE" | grep -qE 'State=(IDLE|ALLOCATED|MIXED)'
}

cmd_node_start() {
    T0=${EPOCHREALTIME/[,.]*/}${EPOCHREALTIME#*[,.]}
    alive "slurmd-$NODE" && die "slurmd of node $NODE is running already"
    spawn "slurmd-$NODE" "$DIR/spool/$NODE" env SLURM_CONF="$CONF" slurmd -D -N "$NODE" -f "$CONF"
    wait_for "slurmd-$NODE" "node $NODE to be back in service" node_up
}

# ---------------------------------------------------------------------------

main() {
    local cmd=${1:-}
    case $cmd in
        install) cmd_install; return ;;
        start | stop | status) ;;
        node-kill | node-start)
            [[ $# -eq 3 && -n $3 ]] || usage
            NODE=$3
            cmd=${cmd/-/_}
            set -- "$1" "$2" ;;
        *) usage ;;
    esac
    [[ $# -eq 2 && -n $2 ]] || usage
    DIR=$(realpath -m -- "$2")
    [[ $DIR != / ]] || die "refusing to use / as the cluster directory"
    # Unix socket paths (munge, MariaDB, slurmstepd under DIR/spool/NODE) are
    # limited to 107 bytes.
    ((${#DIR} <= 70)) || die "DIR is too long for unix socket paths (${#DIR} > 70 characters): $DIR"
    CONF=$DIR/etc/slurm.conf
    RUN=$DIR/run
    LOGDIR=$DIR/log
    DB_PASS=
    T0=
    "cmd_$cmd"
}

main "$@"
