#!/usr/bin/env bash
# Stop the single-node Slurm started by scripts/slurm_up.sh and remove what it added.
# A PID is signalled only if it is the daemon binary named in its pid file AND carries the marker that
# slurm_up.sh puts in its daemons' environment; anything else is reported and left alone.
set -uo pipefail

OWN_DIR=/usr/local/lib/pf-slurm
ADDED=$OWN_DIR/added
CONF=/etc/slurm/slurm.conf
MARKER="# Written by scripts/slurm_up.sh"
OWNER=PF_SLURM_OWNER=scripts/slurm_up.sh
rc=0

DAEMONS="slurmd:/run/slurmd.pid:/usr/sbin/slurmd slurmctld:/run/slurmctld.pid:/usr/sbin/slurmctld
munged:/run/munge/munged.pid:/usr/sbin/munged"

ours() {  # ours PID BINARY: is PID a live BINARY process started by slurm_up.sh?
  [ "$(readlink "/proc/$1/exe" 2>/dev/null)" = "$(readlink -f "$2")" ] \
    && tr '\0' '\n' < "/proc/$1/environ" 2>/dev/null | grep -qxF "$OWNER"
}

pid_in() { [ -f "$1" ] && tr -dc '0-9' < "$1"; }

# First check every pid file, then signal: a pid file naming anything else stops nothing at all.
for d in $DAEMONS; do
  IFS=: read -r name file binary <<< "$d"
  pid="$(pid_in "$file" || true)"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && ! ours "$pid" "$binary"; then
    echo "$name: pid $pid (from $file) is not a $binary started by slurm_up.sh; not signalling it" >&2
    rc=1
  fi
done
if [ "$rc" != 0 ]; then
  echo "slurm_down.sh: stopped nothing; left $CONF and $OWN_DIR in place" >&2
  exit "$rc"
fi

for d in $DAEMONS; do
  IFS=: read -r name file binary <<< "$d"
  pid="$(pid_in "$file" || true)"
  if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
    echo "$name: not running"; rm -f "$file"; continue
  fi
  kill -TERM "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null && ours "$pid" "$binary"; then kill -KILL "$pid"; fi
  rm -f "$file"
  echo "$name: stopped (pid $pid)"
done

# Remove what slurm_up.sh added, newest first; restore a slurm.conf it backed up.
if [ -f "$ADDED" ]; then
  tac "$ADDED" | while read -r item; do
    case "$item" in
      backup:*)
        backup="${item#backup:}"
        if [ -f "$backup" ]; then mv -f "$backup" "$CONF" && echo "restored $CONF from $backup"; fi ;;
      "$CONF")
        if [ -f "$CONF" ] && grep -qxF "$MARKER" "$CONF"; then rm -f "$CONF" && echo "removed $CONF"; fi ;;
      /run/munge)
        rmdir /run/munge 2>/dev/null && echo "removed /run/munge" ;;
      /var/log/slurm/jobcomp.log)
        rm -f "$item" && echo "removed $item" ;;
      *) echo "slurm_down.sh: not removing unexpected entry '$item' of $ADDED" >&2 ;;
    esac
  done
fi
if [ -d "$OWN_DIR" ]; then
  rm -rf "$OWN_DIR" && echo "removed $OWN_DIR"
fi
exit 0
