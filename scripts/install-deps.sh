#!/usr/bin/env bash
# Install the Debian packages Cubicle needs at build, run and test time.
#
# Idempotent and fast when everything is present: packages are checked with
# dpkg-query first; `apt-get update` and `apt-get install` run only when
# something is missing. Must run as root (CI runs as root).
set -euo pipefail

# Runtime / isolation tools, plus what the e2e harness needs (python3-venv for
# tests/e2e/.venv, procps for ps/pgrep diagnostics, curl for health probes).
PACKAGES=(
  nftables debootstrap busybox-static runc bubblewrap xfsprogs iproute2 attr
  util-linux procps curl ca-certificates python3 python3-venv
  btrfs-progs
  libnss-myhostname  # names under localhost resolve to loopback: get_host() with serve's default domain
  docker-registry skopeo  # template e2e: a local OCI registry, and pushing images to it
  gcc libc6-dev  # cubicle-runtime tests compile static C probes (setuid, seccomp)
  debian-archive-keyring  # install-criu.sh verifies the .debs it fetches against it
  chromium  # the dashboard's browser tests (tests/e2e/serve/python/test_dashboard.py, via Playwright)
  postgresql  # the store's PostgreSQL tests and the cluster's: private clusters (scripts/pg-test-cluster.sh)
  openssl  # the cluster e2e suite over TLS makes its CA and certificates with it
  systemd  # systemd-analyze verify checks deploy/systemd's units (scripts/check-deploy.py)
)

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  if [[ "$status" != "installed" ]]; then
    missing+=("$p")
  fi
done

# Node.js (with npm) for the JS SDK end-to-end tests. Any Node.js >= 18 with npm
# will do; only install Debian's when none is on PATH (the build machines ship
# Node.js 20 from another source, and Debian's npm would conflict with it).
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi

if ((${#missing[@]} == 0)); then
  echo "install-deps: all system packages present"
else
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: missing packages (${missing[*]}) and not root; run as root" >&2
    exit 1
  fi
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Tests start their own private PostgreSQL clusters: the package must not create (and
  # start) a system-wide one. Debian's createcluster.conf reads this directory.
  if [[ " ${missing[*]} " == *" postgresql "* ]]; then
    mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.d/cubicle-no-main-cluster.conf
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# CRIU for pause, resume, snapshots and fork: a newer one than Debian 12 ships, in a
# private prefix (see the script for why and how). Fast when already installed.
bash "$(dirname "$0")/install-criu.sh"
