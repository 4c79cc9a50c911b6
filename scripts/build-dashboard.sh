#!/usr/bin/env bash
# Refresh the dashboard's vendored front-end packages (crates/api/dashboard/vendor/) from
# the npm registry, at the versions pinned in crates/api/dashboard/package-lock.json.
#
# The built files are committed: `cargo build` embeds crates/api/dashboard/ into the
# binary and needs neither Node.js nor the network. Run this only to change a version
# (edit package.json, `npm install --package-lock-only` there, then this script).
#
#   @xterm/xterm      lib/xterm.mjs, css/xterm.css   the browser terminal
#   @xterm/addon-fit  lib/addon-fit.mjs              sizes it to its box
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DASH="$ROOT/crates/api/dashboard"
WORK=$(mktemp -d /tmp/cubicle-dashboard.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

cp "$DASH/package.json" "$DASH/package-lock.json" "$WORK/"
(cd "$WORK" && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error)

out="$DASH/vendor"
mkdir -p "$out"
strip_map() { sed '/^\/\/# sourceMappingURL=/d; /^\/\*# sourceMappingURL=/d' "$1" >"$2"; }
nm="$WORK/node_modules/@xterm"
strip_map "$nm/xterm/lib/xterm.mjs" "$out/xterm.mjs"
strip_map "$nm/xterm/css/xterm.css" "$out/xterm.css"
strip_map "$nm/addon-fit/lib/addon-fit.mjs" "$out/addon-fit.mjs"
{
  echo "Vendored by scripts/build-dashboard.sh from the npm registry:"
  for p in xterm addon-fit; do
    echo "  @xterm/$p $(node -p "require('$nm/$p/package.json').version")"
  done
  echo
  echo "--- @xterm/xterm LICENSE ---"
  cat "$nm/xterm/LICENSE"
  echo
  echo "--- @xterm/addon-fit LICENSE ---"
  cat "$nm/addon-fit/LICENSE"
} >"$out/LICENSES.txt"
echo "build-dashboard: vendor/ refreshed:"
ls -l "$out"
