#!/usr/bin/env bash
# Cubicle on a fresh Debian 12 machine: install what it needs, build it, start it.
#
#   sudo scripts/up.sh [extra arguments for `cubicle serve`]
#
# Idempotent: packages are installed only when missing, cargo rebuilds only what
# changed, templates are built once and cached in the state directory
# (/var/lib/cubicle unless CUBICLE_STATE_DIR says otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $(id -u) -ne 0 ]]; then
  echo "scripts/up.sh must run as root (namespaces, cgroups, nftables): sudo scripts/up.sh" >&2
  exit 1
fi
if ! command -v cargo >/dev/null 2>&1; then
  for d in "${SUDO_USER:+$(getent passwd "$SUDO_USER" | cut -d: -f6)/.cargo/bin}" /root/.cargo/bin; do
    [[ -n "$d" && -x "$d/cargo" ]] && PATH="$d:$PATH" && break
  done
fi

bash scripts/install-deps.sh
echo "==> building cubicle (release)"
cargo build --release -p cubicle
bash scripts/build-envd.sh --release
# The node finds the statically linked agent next to the cubicle binary.
install -m 0755 target/x86_64-unknown-linux-gnu/release/cubicle-envd target/release/cubicle-envd
# `cubicle` on PATH (a symlink: the binary still finds cubicle-envd next to its real path).
ln -sfn "$PWD/target/release/cubicle" /usr/local/bin/cubicle

# First start: creates the admin team and API key and builds the `base` and `tiny`
# templates (about a minute) before it prints the export lines and `cubicle: ready`.
exec target/release/cubicle serve "$@"
