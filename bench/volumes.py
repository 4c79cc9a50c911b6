"""What a volume costs (not a test): create latency with and without a mounted volume,
and file I/O on a volume against the sandbox's own root filesystem.

Against a running `cubicle serve` (E2B_API_URL, E2B_API_KEY, E2B_VOLUME_API_URL as it
prints them), through the official Python SDK:

  create               `Sandbox.create(template)` vs `Sandbox.create(template,
                       volume_mounts={"/mnt/v": vol})`, interleaved (A, B, A, B, …) so
                       that drift hits both alike; p50/p90 and the p50 difference. With a
                       warm pool (`serve --pool base=N`) both are claims (the volume is
                       mounted into the claimed sandbox); without, both are cold creates.
  io                   inside one sandbox, the same work on `/home/user/bench` (rootfs:
                       overlay upper on the quota filesystem) and `/mnt/v/bench` (the
                       volume: idmapped bind of a subvolume of the same filesystem),
                       alternating, `--io-rounds` times: sequential write of 256 MiB with
                       fsync, sequential read of it (page cache), 2000 files of 4 KiB
                       created + fsync'd + read + deleted. Minimum and median of each,
                       and volume/rootfs of the minimums.

    sudo tests/e2e/serve/run.sh -- tests/e2e/.venv/bin/python bench/volumes.py [--runs 40] [--template base]
    CUBICLE_POOL=base=4 sudo -E tests/e2e/serve/run.sh -- tests/e2e/.venv/bin/python bench/volumes.py
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from e2b import Sandbox, Volume

IO_SCRIPT = r"""
import os, sys, time
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
big = os.path.join(d, "big")
chunk = os.urandom(1 << 20)
t = time.perf_counter()
with open(big, "wb") as f:
    for _ in range(256):
        f.write(chunk)
    f.flush(); os.fsync(f.fileno())
w = time.perf_counter() - t
t = time.perf_counter()
with open(big, "rb") as f:
    while f.read(1 << 20):
        pass
r = time.perf_counter() - t
os.remove(big)
small = os.path.join(d, "small"); os.makedirs(small, exist_ok=True)
data = b"x" * 4096
t = time.perf_counter()
for i in range(2000):
    p = os.path.join(small, str(i))
    with open(p, "wb") as f:
        f.write(data)
    with open(p, "rb") as f:
        f.read()
dfd = os.open(small, os.O_RDONLY); os.fsync(dfd); os.close(dfd)
os.sync()
for i in range(2000):
    os.remove(os.path.join(small, str(i)))
s = time.perf_counter() - t
print(f"{w:.6f} {r:.6f} {s:.6f}")
"""


def pct(xs, p):
    xs = sorted(xs)
    return xs[max(0, min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1)))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--template", default="base")
    ap.add_argument("--io-rounds", type=int, default=7)
    args = ap.parse_args()

    vol = Volume.create(f"bench-{uuid.uuid4().hex[:8]}")
    try:
        plain, mounted = [], []
        for i in range(args.runs + 2):
            for kind in ("plain", "mounted"):
                opts = {"volume_mounts": {"/mnt/v": vol}} if kind == "mounted" else {}
                t = time.perf_counter()
                s = Sandbox.create(args.template, timeout=120, **opts)
                dt = time.perf_counter() - t
                s.kill()
                if i >= 2:  # warm-up
                    (mounted if kind == "mounted" else plain).append(dt * 1000)
        for name, xs in (("create", plain), ("create+volume", mounted)):
            print(f"{name:<14} n={len(xs)} p50={pct(xs, 50):7.2f} ms  p90={pct(xs, 90):7.2f} ms  mean={statistics.mean(xs):7.2f} ms")
        print(f"volume mount adds (p50 difference): {pct(mounted, 50) - pct(plain, 50):+.2f} ms")

        s = Sandbox.create(args.template, timeout=600, volume_mounts={"/mnt/v": vol})
        try:
            s.files.write("/tmp/io.py", IO_SCRIPT)
            res = {"rootfs": [], "volume": []}
            for _ in range(args.io_rounds):
                for name, d in (("rootfs", "/home/user/bench"), ("volume", "/mnt/v/bench")):
                    out = s.commands.run(f"python3 /tmp/io.py {d}", timeout=600).stdout.split()
                    res[name].append([float(x) for x in out])
            labels = ["seq write 256 MiB+fsync", "seq read 256 MiB", "2000 x 4 KiB files"]
            # The minimum is the capability (on a shared machine interference only ever
            # adds time); the median shows the spread.
            for i, label in enumerate(labels):
                a = [r[i] for r in res["rootfs"]]
                b = [r[i] for r in res["volume"]]
                print(
                    f"{label:<24} min: rootfs {min(a) * 1000:8.1f} ms  volume {min(b) * 1000:8.1f} ms"
                    f"  volume/rootfs {min(b) / min(a):5.2f}   median: {statistics.median(a) * 1000:8.1f}"
                    f" / {statistics.median(b) * 1000:8.1f} ms"
                )
        finally:
            s.kill()
    finally:
        for _ in range(50):
            try:
                Volume.destroy(vol.volume_id)
                break
            except Exception:  # noqa: BLE001 - the last sandbox may still be dying
                time.sleep(0.2)


if __name__ == "__main__":
    main()
