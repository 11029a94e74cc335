#!/usr/bin/env bash
# Start a single-node, loopback-only Slurm for tests and CI (Debian, root, no systemd).
#   bash scripts/slurm_up.sh --install-only   install the packages and stop
#   bash scripts/slurm_up.sh                  install if missing, configure, start, wait for idle
# Stop it with scripts/slurm_down.sh (by PID files). See ../shared/notes/slurm-single-node.md.
set -euo pipefail

SHIM_DIR=/usr/local/lib/pf-slurm/bin     # harness.executors prepends this to PATH
PIDS="/run/munge/munged.pid /run/slurmctld.pid /run/slurmd.pid"

if [ "$(id -u)" != 0 ]; then
  echo "slurm_up.sh: needs root (installs packages and starts daemons)" >&2
  exit 1
fi

install_packages() {
  if command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 \
     && command -v sinfo >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then
    return 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

install_packages
if [ "${1:-}" = "--install-only" ]; then
  echo "slurm packages installed"
  exit 0
fi
if [ -n "${1:-}" ]; then
  echo "slurm_up.sh: unknown argument '$1' (allowed: --install-only)" >&2
  exit 2
fi

HOST="$(hostname -s)"
if sinfo -h -n "$HOST" -o %t 2>/dev/null | grep -Eq '^(idle|mix|alloc|comp)'; then
  echo "slurm already up on $HOST ($(sinfo -h -n "$HOST" -o %t))"
  exit 0
fi

CPUS="$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -1)"
MEM="$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)"

install -d -o munge -g munge -m 0755 /run/munge
install -d -o slurm -g slurm /var/spool/slurmctld /var/log/slurm
install -d /var/spool/slurmd /etc/slurm
touch /var/log/slurm/jobcomp.log && chown slurm:slurm /var/log/slurm/jobcomp.log

cat > /etc/slurm/slurm.conf <<EOF
# Written by scripts/slurm_up.sh: single node, loopback only, no cgroups, no accounting DB.
ClusterName=pfbench
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=slurm
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
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

# sacct without an accounting DB: read the jobcomp file instead (submitit polls sacct).
install -d "$SHIM_DIR"
cat > "$SHIM_DIR/sacct" <<'EOF'
#!/bin/sh
exec /usr/bin/sacct --completion "$@"
EOF
chmod 0755 "$SHIM_DIR/sacct"

running() {  # running PIDFILE: is the daemon named in this pid file alive?
  local pid
  [ -f "$1" ] && pid="$(tr -dc '0-9' < "$1")" && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

if ! running /run/munge/munged.pid && ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
fi
for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n | unmunge >/dev/null

running /run/slurmctld.pid || /usr/sbin/slurmctld
running /run/slurmd.pid || /usr/sbin/slurmd

for _ in $(seq 150); do
  state="$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)"
  if [ "$state" = idle ]; then
    echo "slurm up: node $HOST idle (CPUs=$CPUS RealMemory=$MEM); pid files: $PIDS; sacct shim: $SHIM_DIR"
    exit 0
  fi
  sleep 0.2
done
echo "slurm_up.sh: node $HOST did not become idle (state '${state:-none}'); see /var/log/slurm/" >&2
exit 1
