#!/usr/bin/env bash
# Stop the single-node Slurm started by scripts/slurm_up.sh, by the PIDs in its pid files.
set -uo pipefail

stop_pidfile() {
  local name="$1" file="$2" pid
  [ -f "$file" ] || { echo "$name: no pid file ($file)"; return 0; }
  pid="$(tr -dc '0-9' < "$file")"
  if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
    echo "$name: not running"; rm -f "$file"; return 0
  fi
  kill -TERM "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
  rm -f "$file"
  echo "$name: stopped (pid $pid)"
}

stop_pidfile slurmd /run/slurmd.pid
stop_pidfile slurmctld /run/slurmctld.pid
stop_pidfile munged /run/munge/munged.pid
