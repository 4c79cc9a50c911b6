#!/usr/bin/env bash
# Builds the statically linked agent, cubicle-envd, and the code interpreter,
# cubicle-interpreter (bind-mounted into code-interpreter-v1 sandboxes; see docs/interpreter.md).
#
# cubicle-envd runs inside arbitrary template root filesystems (even busybox-only ones), so
# it is linked statically against glibc (crt-static). The flag goes through RUSTFLAGS with
# an explicit --target so that it applies to the agent only and not to build scripts or
# proc-macros (which cannot be static). Output:
#   target/x86_64-unknown-linux-gnu/<profile>/cubicle-envd
#   target/x86_64-unknown-linux-gnu/<profile>/cubicle-interpreter
# Usage: scripts/build-envd.sh [--release]
set -euo pipefail
cd "$(dirname "$0")/.."
RUSTFLAGS="-C target-feature=+crt-static" exec cargo build -p cubicle-envd -p cubicle-interpreter --target x86_64-unknown-linux-gnu "$@"
