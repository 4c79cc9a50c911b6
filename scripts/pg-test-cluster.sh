#!/usr/bin/env bash
# A private, throw-away PostgreSQL cluster for tests (the store's tests, the cluster
# e2e tests): initdb into a fresh temporary directory, a server on its own Unix socket
# in that directory (and TCP only when asked), trust authentication, no fsync. Nothing
# outside the directory is touched; `stop` removes it.
#
#   scripts/pg-test-cluster.sh start [--owner PID] [--listen ADDR] [--port N] [--trust-net CIDR]
#                                    [--ssl-cert PEM --ssl-key PEM]
#       prints `dir=DIR`, `port=N` and `url=postgres://postgres@…/postgres` (the
#       maintenance database: create your own in it). With --owner, a watcher stops
#       and removes the cluster once process PID has exited (tests need no teardown
#       hook). --listen ADDR also serves TCP on ADDR:PORT (default: Unix socket only);
#       --trust-net CIDR lets clients from that network in (default: only the host's own
#       addresses), e.g. test nodes in network namespaces of their own.
#       --ssl-cert/--ssl-key: ssl=on with that certificate and key (copied into the
#       cluster's directory); TCP clients may then use sslmode=require|verify-full.
#   scripts/pg-test-cluster.sh stop DIR
#
# Uses Debian's `postgresql` package (scripts/install-deps.sh installs it). As root, the
# server runs as the `postgres` user (PostgreSQL refuses root). Exit status 3: no
# PostgreSQL server binaries on this machine.
set -euo pipefail

bindir() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1 || true)
  if [[ -z "$d" || ! -x "$d/initdb" ]]; then
    echo "pg-test-cluster: no PostgreSQL server binaries under /usr/lib/postgresql (apt-get install postgresql; scripts/install-deps.sh does)" >&2
    exit 3
  fi
  echo "$d"
}

as_owner() { # run as the cluster's owner
  if [[ $(id -u) -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

stop() {
  local dir=$1
  [[ -d "$dir" && -f "$dir/.cubicle-pg-test-cluster" ]] || { echo "pg-test-cluster: $dir is not a test cluster" >&2; return 1; }
  if [[ -f "$dir/data/postmaster.pid" ]]; then
    as_owner "$(bindir)/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  rm -rf "$dir"
}

start() {
  local owner="" listen="" port="" trust_net="" ssl_cert="" ssl_key=""
  while (($#)); do
    case $1 in
      --trust-net) trust_net=$2; shift 2 ;;
      --owner) owner=$2; shift 2 ;;
      --listen) listen=$2; shift 2 ;;
      --port) port=$2; shift 2 ;;
      --ssl-cert) ssl_cert=$2; shift 2 ;;
      --ssl-key) ssl_key=$2; shift 2 ;;
      *) echo "pg-test-cluster: unknown option $1" >&2; exit 2 ;;
    esac
  done
  local bin dir
  bin=$(bindir)
  dir=$(mktemp -d /tmp/cubicle-pg.XXXXXX)
  touch "$dir/.cubicle-pg-test-cluster"
  if [[ $(id -u) -eq 0 ]]; then chown postgres: "$dir"; fi
  # Without a port, pick a free one (the socket lives in our own directory, but TCP and
  # the shared-memory key both derive from the port).
  if [[ -z "$port" ]]; then
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  fi
  if ! as_owner "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync \
      --no-instructions >"$dir/initdb.log" 2>&1; then
    cat "$dir/initdb.log" >&2
    rm -rf "$dir"
    exit 1
  fi
  if [[ -n "$trust_net" ]]; then
    echo "host all all $trust_net trust" >> "$dir/data/pg_hba.conf"
  fi
  local ssl_opts=""
  if [[ -n "$ssl_cert" || -n "$ssl_key" ]]; then
    [[ -n "$ssl_cert" && -n "$ssl_key" ]] || { echo "pg-test-cluster: --ssl-cert and --ssl-key go together" >&2; rm -rf "$dir"; exit 2; }
    # The server reads its key only when the owner alone can (0600, owned by it).
    install -m 0644 "$ssl_cert" "$dir/data/server.crt"
    install -m 0600 "$ssl_key" "$dir/data/server.key"
    if [[ $(id -u) -eq 0 ]]; then chown postgres: "$dir/data/server.crt" "$dir/data/server.key"; fi
    ssl_opts="-c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key"
  fi
  # Durability is not wanted here: no fsync, no full-page writes. Many connections: each
  # test store keeps a small pool, and tests run in parallel.
  if ! as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 \
      -o "-p $port -k $dir -c listen_addresses='${listen}' -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=400 -c shared_buffers=32MB $ssl_opts" \
      start >/dev/null; then
    cat "$dir/server.log" >&2 || true
    rm -rf "$dir"
    exit 1
  fi
  if [[ -n "$owner" ]]; then
    # Detached from our caller's pipes, so that whoever reads our stdout sees its end.
    setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 0.5; done; exec bash "$2" stop "$3"' \
      _ "$owner" "$0" "$dir" </dev/null >/dev/null 2>&1 &
  fi
  local host=${dir//\//%2F}
  echo "dir=$dir"
  echo "port=$port"
  echo "url=postgres://postgres@$host:$port/postgres"
  if [[ -n "$listen" ]]; then echo "tcp_url=postgres://postgres@$listen:$port/postgres"; fi
}

case ${1:-} in
  start) shift; start "$@" ;;
  stop) stop "${2:?usage: pg-test-cluster.sh stop DIR}" ;;
  *) echo "usage: pg-test-cluster.sh start [--owner PID] [--listen ADDR] [--port N] [--trust-net CIDR] [--ssl-cert PEM --ssl-key PEM] | stop DIR" >&2; exit 2 ;;
esac
