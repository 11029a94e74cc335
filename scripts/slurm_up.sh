#!/usr/bin/env bash
# Start a single-node Slurm for tests and CI, reachable over loopback only (Debian, root, no systemd).
#   bash scripts/slurm_up.sh --install-only   install the packages (says which) and stop
#   bash scripts/slurm_up.sh                  install if missing, configure, start fenced, wait for idle
#   bash scripts/slurm_up.sh --replace-conf   also replace an /etc/slurm/slurm.conf this script did not
#                                             write (it is backed up; slurm_down.sh puts it back)
# The fence: Slurm 22.05 binds 0.0.0.0 and has no bind-address option, so the daemons, and through
# TaskProlog every job step (srun listens too), run with an LD_PRELOAD shim (scripts/slurm/loopback_bind.c,
# compiled here) that moves every bind to 127.0.0.1 / ::1. tests/harness/execute/test_slurm_fence.py checks the sockets.
# What this script adds is listed in $OWN_DIR/added; scripts/slurm_down.sh stops the daemons it started
# and removes exactly that. See ../shared/notes/slurm-single-node.md.
set -euo pipefail

OWN_DIR=/usr/local/lib/pf-slurm                 # everything this script installs lives here
SHIM_DIR=$OWN_DIR/bin                           # harness.execute.executors prepends this to PATH (sacct shim)
BIND_SHIM=$OWN_DIR/libpf_loopback_bind.so
TASK_PROLOG=$OWN_DIR/task_prolog.sh
ADDED=$OWN_DIR/added                            # one line per thing added, read by slurm_down.sh
CONF=/etc/slurm/slurm.conf
BACKUP=/etc/slurm/slurm.conf.pf-bench-backup
MARKER="# Written by scripts/slurm_up.sh"
OWNER=PF_SLURM_OWNER=scripts/slurm_up.sh        # in the daemons' environment: slurm_down.sh checks it
SRC="$(cd "$(dirname "$0")" && pwd)/slurm/loopback_bind.c"
PIDS="/run/munge/munged.pid /run/slurmctld.pid /run/slurmd.pid"

replace_conf=0 install_only=0
for arg in "$@"; do
  case "$arg" in
    --install-only) install_only=1 ;;
    --replace-conf) replace_conf=1 ;;
    *) echo "slurm_up.sh: unknown argument '$arg' (allowed: --install-only, --replace-conf)" >&2; exit 2 ;;
  esac
done

if [ "$(id -u)" != 0 ]; then
  echo "slurm_up.sh: needs root (installs packages and starts daemons)" >&2
  exit 1
fi

install_packages() {  # only what is missing, and say so
  local missing=()
  command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
  command -v sinfo >/dev/null 2>&1 || missing+=(slurm-client)
  command -v munged >/dev/null 2>&1 || missing+=(munge)
  command -v gcc >/dev/null 2>&1 || missing+=(gcc)
  [ -f /usr/include/netinet/in.h ] || missing+=(libc6-dev)
  command -v ss >/dev/null 2>&1 || missing+=(iproute2)
  if [ ${#missing[@]} = 0 ]; then
    return 0
  fi
  echo "slurm_up.sh: installing Debian packages: ${missing[*]} (apt-get, --no-install-recommends)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

install_packages
if [ "$install_only" = 1 ]; then
  echo "slurm packages installed"
  exit 0
fi

add() {  # add WHAT: remember that this script added WHAT (a path), once
  grep -qxF "$1" "$ADDED" 2>/dev/null || echo "$1" >> "$ADDED"
}

listeners_not_loopback() {  # the non-loopback TCP listening addresses on Slurm's ports 6817/6818
  ss -H -ltn '( sport = :6817 or sport = :6818 )' 2>/dev/null | awk '{print $4}' \
    | grep -Ev '^(127\.[0-9.]+|\[::1\]|\[::ffff:127\.[0-9.]+\]):[0-9]+$' || true
}

pid_of() { [ -f "$1" ] && tr -dc '0-9' < "$1"; }

if [ -e "$CONF" ] && ! grep -qxF "$MARKER" "$CONF"; then
  if [ "$replace_conf" != 1 ]; then
    echo "slurm_up.sh: $CONF was not written by this script; refusing to overwrite it." \
         "Rerun with --replace-conf to back it up to $BACKUP (scripts/slurm_down.sh restores it)." >&2
    exit 1
  fi
  if [ -e "$BACKUP" ]; then
    echo "slurm_up.sh: $BACKUP already exists; move it away first (it may be the only copy)" >&2
    exit 1
  fi
fi

HOST="$(hostname -s)"
if sinfo -h -n "$HOST" -o %t 2>/dev/null | grep -Eq '^(idle|mix|alloc|comp)'; then
  open="$(listeners_not_loopback)"
  if [ -n "$open" ]; then
    echo "slurm_up.sh: a Slurm is up on $HOST but listens beyond loopback ($(echo $open)); stop it" \
         "(scripts/slurm_down.sh, or by hand if another tool started it) and rerun" >&2
    exit 1
  fi
  echo "slurm already up on $HOST ($(sinfo -h -n "$HOST" -o %t)), loopback only"
  exit 0
fi

CPUS="$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -1)"
MEM="$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)"

install -d -m 0755 "$OWN_DIR" "$SHIM_DIR"
touch "$ADDED"
if [ ! -d /run/munge ]; then
  install -d -o munge -g munge -m 0755 /run/munge
  add /run/munge
fi
install -d -o slurm -g slurm /var/lib/slurm/slurmctld /var/log/slurm
install -d /var/lib/slurm/slurmd /etc/slurm
if [ ! -e /var/log/slurm/jobcomp.log ]; then
  install -o slurm -g slurm -m 0644 /dev/null /var/log/slurm/jobcomp.log
  add /var/log/slurm/jobcomp.log
fi

# The loopback fence: compiled from the repository's source into our own folder.
gcc -shared -fPIC -O2 -Wall -o "$BIND_SHIM.tmp" "$SRC" -ldl
chmod 0644 "$BIND_SHIM.tmp" && mv -f "$BIND_SHIM.tmp" "$BIND_SHIM"
cat > "$TASK_PROLOG" <<EOF
#!/bin/sh
# Run by slurmstepd before every task: job steps (srun listens for I/O) bind loopback only.
echo "export LD_PRELOAD=$BIND_SHIM\${LD_PRELOAD:+ \$LD_PRELOAD}"
EOF
chmod 0755 "$TASK_PROLOG"

# sacct without an accounting DB: read the jobcomp file instead (submitit polls sacct).
cat > "$SHIM_DIR/sacct" <<'EOF'
#!/bin/sh
exec /usr/bin/sacct --completion "$@"
EOF
chmod 0755 "$SHIM_DIR/sacct"

if [ -e "$CONF" ] && ! grep -qxF "$MARKER" "$CONF"; then
  cp -p "$CONF" "$BACKUP"
  echo "slurm_up.sh: backed up $CONF to $BACKUP"
  add "backup:$BACKUP"
fi
cat > "$CONF.tmp" <<EOF
$MARKER
# Single node, loopback only (binds moved to 127.0.0.1 by $BIND_SHIM), no cgroups, no accounting DB.
ClusterName=pfbench
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=slurm
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog=$TASK_PROLOG
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=5
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${MEM} State=UNKNOWN
PartitionName=debug Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP
EOF
mv -f "$CONF.tmp" "$CONF"
add "$CONF"

running() {  # running PIDFILE: is the daemon named in this pid file alive?
  local pid
  pid="$(pid_of "$1" || true)" && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

if ! running /run/munge/munged.pid && ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- env "$OWNER" /usr/sbin/munged
fi
for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n | unmunge >/dev/null

running /run/slurmctld.pid || env "$OWNER" LD_PRELOAD="$BIND_SHIM" /usr/sbin/slurmctld
running /run/slurmd.pid || env "$OWNER" LD_PRELOAD="$BIND_SHIM" /usr/sbin/slurmd

for _ in $(seq 150); do
  state="$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)"
  if [ "$state" = idle ]; then
    open="$(listeners_not_loopback)"
    if [ -n "$open" ]; then
      echo "slurm_up.sh: the fence failed: Slurm listens on $(echo $open); stopping it" >&2
      bash "$(dirname "$0")/slurm_down.sh" >&2 || true
      exit 1
    fi
    echo "slurm up: node $HOST idle (CPUs=$CPUS RealMemory=$MEM), listening on loopback only;" \
         "pid files: $PIDS; added: $(tr '\n' ' ' < "$ADDED")"
    exit 0
  fi
  sleep 0.2
done
echo "slurm_up.sh: node $HOST did not become idle (state '${state:-none}'); see /var/log/slurm/" >&2
exit 1
