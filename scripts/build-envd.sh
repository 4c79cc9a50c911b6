#!/usr/bin/env bash
# Builds the statically linked agent, cubicle-envd, and the code interpreter,
# cubicle-interpreter (bind-mounted into code-interpreter-v1 sandboxes; see docs/interpreter.md).
#
# cubicle-envd runs inside arbitrary template root filesystems (even busybox-only ones), so
# it is linked statically against glibc (crt-static). The flag goes through RUSTFLAGS with
# an explicit --target so that it applies to the agent only and not to build scripts or
# proc-macros (which cannot be static).
#
# Not position-independent (relocation-model=static): a static-pie binary relocates its
# .data.rel.ro and GOT (about 160 KiB, 10,000 relocations) at every start, which makes
# those pages private to each sandbox; a fixed-address binary leaves them clean and shared
# by every envd on the host. Address randomisation of envd's own image protects nothing
# here: the sandbox's root can already ptrace envd. Output:
#   target/x86_64-unknown-linux-gnu/<profile>/cubicle-envd
#   target/x86_64-unknown-linux-gnu/<profile>/cubicle-interpreter
# Usage: scripts/build-envd.sh [--release]
set -euo pipefail
cd "$(dirname "$0")/.."
RUSTFLAGS="-C target-feature=+crt-static -C relocation-model=static" exec cargo build -p cubicle-envd -p cubicle-interpreter --target x86_64-unknown-linux-gnu "$@"
