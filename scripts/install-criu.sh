#!/usr/bin/env bash
# Install CRIU (checkpoint/restore in userspace) into a private prefix, for pause, resume,
# snapshots and fork (crates/checkpoint).
#
# Why not `apt-get install criu`: Debian 12's criu 3.17 fails `criu check` on current
# kernels (vDSO bounds). Debian 13's 4.1.1 passes `criu check` but cannot dump a TCP
# socket on kernels >= 6.16, which refuse SO_PASSCRED/SO_PASSSEC on inet sockets (fixed
# in CRIU 4.2, commit "criu/sockets: Restrict SO_PASSCRED and SO_PASSSEC to supported
# families"); every sandbox has one (envd listens on TCP). So this takes criu 4.2+ and
# the libraries it links against, including the C library and its loader, from Debian
# testing (forky), and unpacks them into $PREFIX without touching the host's packages:
#
#   $PREFIX/root/...        the unpacked .debs (dpkg-deb -x), never on the host's paths
#   $PREFIX/criu            wrapper: runs trixie's loader on trixie's criu with trixie's libs
#
# Downloads go through apt itself, with a private configuration and state (nothing in
# /etc/apt or /var/lib/apt changes), from deb.debian.org only; apt verifies every .deb
# against the Release file signed with the Debian archive keys already on the host
# (debian-archive-keyring). Versions are whatever the suite serves today (old versions
# leave the pool, so pinning them would break the install). Testing's Release file
# carries a one-week Valid-Until; mirrors and clocks of build machines drift, so that
# date is not enforced (the signature still is).
#
# Idempotent: does nothing when "$PREFIX/criu check" already passes.
# Environment: CUBICLE_CRIU_PREFIX (default /usr/local/lib/cubicle/criu),
# CUBICLE_CRIU_SUITE (default forky).
set -euo pipefail

PREFIX=${CUBICLE_CRIU_PREFIX:-/usr/local/lib/cubicle/criu}
SUITE=${CUBICLE_CRIU_SUITE:-forky}
MIRROR=http://deb.debian.org/debian
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

if [[ -x "$PREFIX/criu" ]] && "$PREFIX/criu" check >/dev/null 2>&1; then
  echo "install-criu: $("$PREFIX/criu" --version | head -1) in $PREFIX passes criu check"
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "install-criu: CRIU missing in $PREFIX and not root; run as root" >&2
  exit 1
fi
for tool in apt-get dpkg-deb; do
  command -v "$tool" >/dev/null || { echo "install-criu: $tool not found (Debian host expected)" >&2; exit 1; }
done
[[ -r $KEYRING ]] || { echo "install-criu: $KEYRING missing: apt-get install debian-archive-keyring" >&2; exit 1; }

work=$(mktemp -d /tmp/cubicle-criu.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work"/{etc/parts,etc/sources.d,etc/prefs.d,state/lists/partial,cache/archives/partial,debs}
touch "$work/state/status"
echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" >"$work/etc/sources.list"
cat >"$work/apt.conf" <<EOF
Dir::Etc::Main "$work/apt.conf";
Dir::Etc::Parts "$work/etc/parts";
Dir::Etc::SourceList "$work/etc/sources.list";
Dir::Etc::SourceParts "$work/etc/sources.d";
Dir::Etc::Preferences "$work/etc/prefs";
Dir::Etc::PreferencesParts "$work/etc/prefs.d";
Dir::State "$work/state";
Dir::State::status "$work/state/status";
Dir::Cache "$work/cache";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
Acquire::Languages "none";
APT::Sandbox::User "root";
Acquire::Check-Valid-Until "false";
EOF
apt_private() { APT_CONFIG="$work/apt.conf" "$@"; }

echo "install-criu: reading the $SUITE package index from $MIRROR"
apt_private apt-get update -qq
# criu and everything it needs, resolved against an empty package database so the
# closure includes trixie's own C library and loader.
mapfile -t pkgs < <(apt_private apt-get -s install --no-install-recommends criu |
  awk '$1 == "Inst" { print $2 }')
[[ ${#pkgs[@]} -gt 0 ]] || { echo "install-criu: could not resolve criu in $SUITE" >&2; exit 1; }
echo "install-criu: downloading ${pkgs[*]}"
(cd "$work/debs" && apt_private apt-get download -qq "${pkgs[@]}")

staging="$PREFIX.new"
rm -rf "$staging"
mkdir -p "$staging/root"
for deb in "$work"/debs/*.deb; do
  dpkg-deb -x "$deb" "$staging/root"
done
(cd "$work/debs" && ls *.deb) >"$staging/packages.txt"

# usrmerge: trixie's libc lives in usr/lib; the loader path inside the .deb is
# usr/lib64/ld-linux-x86-64.so.2 (or lib64/... on older layouts).
loader=""
for l in usr/lib64/ld-linux-x86-64.so.2 lib64/ld-linux-x86-64.so.2 usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2; do
  if [[ -e "$staging/root/$l" ]]; then loader=$l; break; fi
done
[[ -n $loader ]] || { echo "install-criu: no loader in the unpacked packages" >&2; exit 1; }
bin=""
for b in usr/sbin/criu sbin/criu; do
  if [[ -x "$staging/root/$b" ]]; then bin=$b; break; fi
done
[[ -n $bin ]] || { echo "install-criu: no criu binary in the unpacked packages" >&2; exit 1; }

libs="$PREFIX/root/usr/lib/x86_64-linux-gnu:$PREFIX/root/lib/x86_64-linux-gnu"
cat >"$staging/criu" <<EOF
#!/bin/sh
# CRIU from Debian $SUITE with its own libraries and loader (scripts/install-criu.sh).
exec "$PREFIX/root/$loader" --library-path "$libs" "$PREFIX/root/$bin" "\$@"
EOF
chmod 0755 "$staging/criu"

old="$PREFIX.old"
rm -rf "$old"
[[ -e $PREFIX ]] && mv "$PREFIX" "$old"
mv "$staging" "$PREFIX"
rm -rf "$old"

if ! out=$("$PREFIX/criu" check 2>&1); then
  echo "install-criu: criu check fails on this kernel:" >&2
  echo "$out" >&2
  exit 1
fi
echo "install-criu: $("$PREFIX/criu" --version | head -1) installed in $PREFIX; criu check: $out"
