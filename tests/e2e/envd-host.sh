#!/usr/bin/env bash
# Run a command next to a development-mode `cubicle-envd`, isolated from the host.
#
#   tests/e2e/envd-host.sh [--no-envd] [--] CMD [ARGS...]
#
# Everything (envd and CMD) runs inside a private network namespace and a private
# mount namespace, so envd's fixed port 49983 (hard-coded by the SDKs' debug
# mode) never collides with anything on the host and nothing is mounted on the
# host. Inside the namespaces:
#   * `lo` is up; envd listens on localhost:49983 (`--dev --default-user user`).
#   * /etc/passwd and /etc/group are bind-mounted copies of the host's with a
#     `user` (uid/gid 1000, home /home/user, /bin/bash) like an E2B sandbox; a
#     host entry with uid/gid 1000 or the name `user` is replaced.
#   * /home (holding /home/user, owned 1000:1000) and /tmp are fresh tmpfs mounts.
#   * /root is a fresh tmpfs with a minimal .bashrc/.profile: the SDK runs every
#     command as `/bin/bash -l -c CMD`, and the host's root profile (pyenv init)
#     is slow and can hang login shells.
#   * /etc and /usr are read-only: a misbehaving envd cannot damage the host.
#   * If the repository itself lives under /root, /home or /tmp it is bind-mounted
#     back at its own path, so absolute paths to the venv, node_modules and the
#     envd binary keep working.
#   * CUBICLE_E2E_SCRATCH is an empty disk-backed directory (mode 1777) for big
#     files (the 2 GiB upload test); removed on exit.
#   * When CMD ends, envd and every other process left in the network namespace
#     (a second envd a test started, orphans) are ended and reported.
# Exported to CMD: E2B_DEBUG=true, CUBICLE_ENVD_URL, CUBICLE_ENVD_PID,
# CUBICLE_ENVD_BIN, CUBICLE_ENVD_LOGFILE, CUBICLE_ENVD_FD_PROBE (a file envd holds open
# on an inherited fd 7), CUBICLE_E2E_SCRATCH, CUBICLE_E2E_INNER=1.
#
# The envd binary: $CUBICLE_ENVD_BIN, else the newest of
# target/x86_64-unknown-linux-gnu/debug/cubicle-envd and target/debug/cubicle-envd.
# With --no-envd no envd is started (CMD may start its own).
# Exit status: CMD's; 1 (with envd's log) when envd did not become healthy.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SELF="$ROOT/tests/e2e/envd-host.sh"
PORT=49983

start_envd=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --no-envd) start_envd=0; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [--no-envd] [--] CMD [ARGS...]" >&2
  exit 2
fi

# ---------------------------------------------------------------------------
# Stage 1 (host): re-exec inside fresh network + mount namespaces.
if [[ "${CUBICLE_E2E_INNER:-}" != "1" ]]; then
  if [[ $(id -u) -ne 0 ]]; then
    echo "envd-host: needs root (namespaces, bind mounts, setuid to the test user)" >&2
    exit 1
  fi
  args=()
  [[ $start_envd -eq 0 ]] && args+=(--no-envd)
  export CUBICLE_E2E_INNER=1
  exec unshare --net --mount --propagation private -- "$SELF" "${args[@]}" -- "$@"
fi

# ---------------------------------------------------------------------------
# Stage 2 (inside the namespaces).
ip link set lo up

# The repository must stay reachable at its own path when /root, /home or /tmp
# get a fresh tmpfs below: hold it open and bind it back from the open fd.
rebind=0
for dir in /root /home /tmp; do
  if [[ "$ROOT/" == "$dir/"* ]]; then rebind=1; fi
done
exec {repo_fd}<"$ROOT"

# A private /tmp: whatever the tests (or a misbehaving envd) leave there vanishes.
mount -t tmpfs -o mode=1777,size=2g cubicle-e2e-tmp /tmp
WORK=$(mktemp -d /tmp/cubicle-e2e.XXXXXX)
SCRATCH=$(mktemp -d /var/tmp/cubicle-e2e-scratch.XXXXXX)
chmod 1777 "$SCRATCH"
ENVD_PID=""

descendants() { # pids of all descendants of $1
  local parent=$1 pid
  for pid in $(ps -o pid= --ppid "$parent" 2>/dev/null); do
    echo "$pid"
    descendants "$pid"
  done
}

cleanup() {
  local rc=$?
  if [[ -n "$ENVD_PID" ]] && kill -0 "$ENVD_PID" 2>/dev/null; then
    local left
    left=$(descendants "$ENVD_PID" | tr '\n' ' ')
    if [[ -n "${left// /}" ]]; then
      echo "envd-host: processes still running under envd at exit: $left" >&2
      ps -o pid,ppid,user,etime,args -p "${left// /,}" >&2 2>/dev/null || true
    fi
    kill -TERM "$ENVD_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$ENVD_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$ENVD_PID" 2>/dev/null || true
    for p in $left; do kill -KILL "$p" 2>/dev/null || true; done
  fi
  # Anything else still in this network namespace (e.g. a second envd a test
  # started, or a process that outlived envd) was started by this run: end it.
  local netns p pid stray=()
  netns=$(readlink /proc/$$/ns/net)
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    [[ "$pid" == "$$" || "$pid" == "${BASHPID:-}" ]] && continue
    [[ "$(readlink "$p/ns/net" 2>/dev/null)" == "$netns" ]] || continue
    [[ "$(cat "$p/comm" 2>/dev/null)" == "readlink" ]] && continue
    stray+=("$pid")
  done
  if ((${#stray[@]})); then
    echo "envd-host: ending stray processes of this run: ${stray[*]}" >&2
    ps -o pid,ppid,user,etime,args -p "$(IFS=,; echo "${stray[*]}")" >&2 2>/dev/null || true
    kill -KILL "${stray[@]}" 2>/dev/null || true
  fi
  rm -rf "$SCRATCH" "$WORK" 2>/dev/null || true
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- users: host entries + `user` 1000:1000 -----------------------------------
awk -F: '$1 != "user" && $3 != "1000"' /etc/passwd >"$WORK/passwd"
echo 'user:x:1000:1000:Cubicle test user:/home/user:/bin/bash' >>"$WORK/passwd"
awk -F: '$1 != "user" && $3 != "1000"' /etc/group >"$WORK/group"
echo 'user:x:1000:' >>"$WORK/group"
chmod 0644 "$WORK/passwd" "$WORK/group"
mount --bind "$WORK/passwd" /etc/passwd
mount --bind "$WORK/group" /etc/group

# --- fresh /home/user and /root ---------------------------------------------------
mount -t tmpfs -o mode=0755,size=1g cubicle-e2e-home /home
mkdir -p /home/user
chown 1000:1000 /home/user
chmod 0750 /home/user

mount -t tmpfs -o mode=0700,size=256m cubicle-e2e-root /root
cat >/root/.profile <<'PROFILE'
# Minimal profile for Cubicle's e2e tests (the host's is hidden).
if [ -n "$BASH_VERSION" ] && [ -f "$HOME/.bashrc" ]; then . "$HOME/.bashrc"; fi
PROFILE
cat >/root/.bashrc <<'BASHRC'
# Minimal bashrc for Cubicle's e2e tests (the host's is hidden).
BASHRC

if [[ $rebind -eq 1 ]]; then
  mkdir -p "$ROOT"
  mount --no-canonicalize --bind "/proc/$$/fd/$repo_fd" "$ROOT"
fi
exec {repo_fd}<&-

# The host's system directories are read-only in here: a misbehaving envd under
# test cannot damage them (the test passwd/group are bind-mounted on top).
for dir in /etc /usr; do
  mount --rbind "$dir" "$dir"
  mount -o remount,bind,ro "$dir"
done

export CUBICLE_E2E_SCRATCH="$SCRATCH"
export E2B_DEBUG=true
export CUBICLE_ENVD_URL="http://localhost:$PORT"
export HOME=/root

# --- envd ---------------------------------------------------------------------------
if [[ $start_envd -eq 1 ]]; then
  ENVD="${CUBICLE_ENVD_BIN:-}"
  if [[ -z "$ENVD" ]]; then
    ENVD=$(ls -t "$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
                 "$ROOT/target/debug/cubicle-envd" 2>/dev/null | head -n1 || true)
  fi
  if [[ -z "$ENVD" || ! -x "$ENVD" ]]; then
    echo "envd-host: no cubicle-envd binary (build with: cargo build -p cubicle-envd)" >&2
    exit 1
  fi
  ENVD=$(realpath "$ENVD")
  LOG="$WORK/envd.log"
  PROBE="$WORK/inherited-fd-probe"
  : >"$PROBE"
  # A clean environment for envd (its PATH is what commands see) and clean fds:
  # whatever this script inherited is closed, then exactly one extra fd is handed
  # to envd on purpose, $PROBE on fd 7 (not close-on-exec): sandbox processes must
  # never see an fd envd inherited (test_commands.py::test_child_sees_only_stdio).
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      if ((fd > 2 && fd != 255)); then eval "exec $fd>&-" 2>/dev/null || true; fi
    done
    exec 7<"$PROBE"
    exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
      CUBICLE_ENVD_LOG="${CUBICLE_ENVD_LOG:-info}" RUST_BACKTRACE=1 \
      "$ENVD" --dev --port "$PORT" --default-user user >"$LOG" 2>&1
  ) &
  ENVD_PID=$!
  healthy=0
  for _ in $(seq 300); do
    if ! kill -0 "$ENVD_PID" 2>/dev/null; then break; fi
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$PORT/health" || true)
    if [[ "$code" == "204" ]]; then healthy=1; break; fi
    sleep 0.1
  done
  if [[ $healthy -ne 1 ]]; then
    echo "envd-host: envd ($ENVD) did not answer GET /health with 204; its log:" >&2
    cat "$LOG" >&2 || true
    exit 1
  fi
  export CUBICLE_ENVD_PID="$ENVD_PID" CUBICLE_ENVD_BIN="$ENVD" CUBICLE_ENVD_LOGFILE="$LOG" \
    CUBICLE_ENVD_FD_PROBE="$PROBE"
  echo "envd-host: $ENVD (pid $ENVD_PID) healthy on localhost:$PORT"
fi

set +e
"$@"
rc=$?
set -e
if [[ $rc -ne 0 && -n "${LOG:-}" && -f "$LOG" ]]; then
  echo "envd-host: command failed (rc=$rc); last 60 lines of envd's log:" >&2
  tail -n 60 "$LOG" >&2 || true
fi
exit $rc
