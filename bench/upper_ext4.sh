#!/usr/bin/env bash
# What an ext4 writable layer per sandbox would cost (issue 20, point 4: E2B's ext4
# reports 4096 for a directory, Cubicle's btrfs quota filesystem 0).
#
# Both layouts live in a private btrfs quota filesystem (a sparse image with qgroups,
# as the node makes when the host has no XFS project quotas), N sandboxes each:
#
#   btrfs  what the node does now: a subvolume with a qgroup limit, upper/ and work/
#          in it;
#   ext4   the alternative: a sparse ext4 image of the disk size in the quota
#          filesystem (its size is the quota), loop-mounted, upper/ and work/ in it.
#
# Printed per sandbox: time to make and to remove the layer (through the command-line
# tools, so a few ms of fork/exec each in both layouts), host memory (MemTotal -
# MemAvailable after dropping clean caches) and Slab (both noisy on a shared host),
# kernel stacks + per-CPU memory, kernel threads, disk blocks an empty layer takes, an
# empty directory's size. Compare with the 1.3 MiB an idle sandbox costs in
# all (docs/bench.md). Not measured: every ext4 superblock also registers memcg-aware
# shrinkers, which grow every memory cgroup's shrinker map (docs/architecture.md).
#
#   sudo bench/upper_ext4.sh [N=200] [DIR=/var/lib/cubicle-bench-ext4] [SIZE_MB=5120] [JOURNAL=0|1]
#
# Runs in a private mount namespace; removes everything it made (also on Ctrl-C).
set -euo pipefail
N=${1:-200}
DIR=${2:-/var/lib/cubicle-bench-ext4}
SIZE_MB=${3:-5120}
JOURNAL=${4:-0}
if [[ $(id -u) -ne 0 ]]; then echo "needs root" >&2; exit 1; fi
for t in mkfs.btrfs btrfs mkfs.ext4 losetup; do
  command -v $t >/dev/null || { echo "$t missing (btrfs-progs, e2fsprogs, util-linux)" >&2; exit 1; }
done
if [[ "${UPPER_EXT4_INNER:-}" != 1 ]]; then
  export UPPER_EXT4_INNER=1
  exec unshare --mount --propagation private -- "$0" "$@"
fi

Q="$DIR/q"
LOOPS=()
QLOOP=""
cleanup() {
  set +e
  for m in "$Q"/m*; do mountpoint -q "$m" 2>/dev/null && umount "$m"; done
  for l in "${LOOPS[@]}"; do losetup -d "$l" 2>/dev/null; done
  mountpoint -q "$Q" 2>/dev/null && umount "$Q"
  [[ -n "$QLOOP" ]] && losetup -d "$QLOOP" 2>/dev/null
  rm -rf "$DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$Q"
truncate -s $((N * 64 + 4096))M "$DIR/quota.img"
mkfs.btrfs -q -f "$DIR/quota.img" >/dev/null
QLOOP=$(losetup --find --show "$DIR/quota.img")
mount -t btrfs "$QLOOP" "$Q"
btrfs quota enable "$Q"

mem_used_kib() { awk '/^MemTotal:/{t=$2} /^MemAvailable:/{a=$2} END{print t-a}' /proc/meminfo; }
slab_kib() { awk '/^Slab:/{print $2}' /proc/meminfo; }
# kernel stacks + per-CPU areas: the part of a layer's kernel memory that other
# processes on a busy host hardly move
kstack_percpu_kib() { awk '/^KernelStack:/{k=$2} /^Percpu:/{p=$2} END{print k+p}' /proc/meminfo; }
kthreads() { ps -e -o ppid= | awk '$1==2' | wc -l; }
now_ns() { date +%s%N; }
mkfs_opts=(-q -F -m 0 -E lazy_itable_init=1,lazy_journal_init=1)
[[ $JOURNAL == 1 ]] || mkfs_opts+=(-O ^has_journal)

make_btrfs() { # i
  btrfs -q subvolume create "$Q/s$1" >/dev/null
  btrfs qgroup limit "${SIZE_MB}M" "$Q/s$1"
  mkdir "$Q/s$1/upper" "$Q/s$1/work"
}
remove_btrfs() { btrfs -q subvolume delete "$Q/s$1" >/dev/null; }
make_ext4() { # i
  truncate -s "${SIZE_MB}M" "$Q/i$1.img"
  mkfs.ext4 "${mkfs_opts[@]}" "$Q/i$1.img"
  local l
  l=$(losetup --find --show "$Q/i$1.img")
  LOOPS+=("$l")
  mkdir -p "$Q/m$1"
  mount -t ext4 "$l" "$Q/m$1"
  mkdir "$Q/m$1/upper" "$Q/m$1/work"
}
remove_ext4() { # i
  umount "$Q/m$1"
  rm -f "$Q/i$1.img"
}

measure() { # layout
  local layout=$1 t0 t1 t2 t3 m0 m1 s0 s1 k0 k1 p0 p1 dsize used
  sync; echo 3 >/proc/sys/vm/drop_caches
  sleep 2
  m0=$(mem_used_kib); s0=$(slab_kib); k0=$(kthreads); p0=$(kstack_percpu_kib)
  t0=$(now_ns)
  for i in $(seq 0 $((N - 1))); do "make_$layout" "$i"; done
  t1=$(now_ns)
  sync; echo 3 >/proc/sys/vm/drop_caches; sleep 3
  m1=$(mem_used_kib); s1=$(slab_kib); k1=$(kthreads); p1=$(kstack_percpu_kib)
  if [[ $layout == btrfs ]]; then
    dsize=$(stat -c %s "$Q/s0/upper")
    btrfs filesystem sync "$Q"
    used=$(( $(btrfs qgroup show --raw "$Q" | awk -v id="0/$(btrfs inspect-internal rootid "$Q/s0")" '$1==id {print $2}') / 1024 ))
  else
    dsize=$(stat -c %s "$Q/m0/upper")
    used=$(du -sk "$Q/i0.img" | cut -f1)
  fi
  t2=$(now_ns)
  for i in $(seq 0 $((N - 1))); do "remove_$layout" "$i"; done
  if [[ $layout == ext4 ]]; then
    for l in "${LOOPS[@]}"; do losetup -d "$l"; done
    LOOPS=()
  fi
  t3=$(now_ns)
  awk -v L="$layout" -v n="$N" -v c="$((t1 - t0))" -v r="$((t3 - t2))" -v dm="$((m1 - m0))" \
      -v ds="$((s1 - s0))" -v dk="$((k1 - k0))" -v dp="$((p1 - p0))" -v e="$dsize" -v u="$used" 'BEGIN {
    printf "%-6s make %6.1f ms  remove %6.1f ms  memory %6.0f KiB  slab %5.0f KiB  stacks+percpu %4.0f KiB  kthreads %4.2f  disk %5d KiB  empty dir %d\n",
      L, c / n / 1e6, r / n / 1e6, dm / n, ds / n, dp / n, dk / n, u, e
  }'
}

echo "N=$N sandboxes, ${SIZE_MB} MiB quota each, ext4 journal=$JOURNAL; per sandbox:"
measure btrfs
measure ext4
