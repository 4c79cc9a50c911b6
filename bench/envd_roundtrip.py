#!/usr/bin/env python3
"""Round-trip latency of `commands.run("true")` against envd directly (not a test).

Uses the official e2b Python SDK in debug mode (E2B_DEBUG=true: localhost:49983, no
control plane). Run it next to a development-mode envd, e.g.:

    sudo tests/e2e/envd-host.sh tests/e2e/.venv/bin/python bench/envd_roundtrip.py

Options: -n CALLS (default 1000), --warmup N (default 20), --user NAME.
Prints p50 / p90 / p99 / max / mean in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def percentile(sorted_values, p):
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1000, help="measured calls")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--user", default=None, help="run as this user (default: envd's default user)")
    ap.add_argument("--cmd", default="true")
    args = ap.parse_args()

    os.environ.setdefault("E2B_DEBUG", "true")
    from e2b import Sandbox  # imported after E2B_DEBUG is set

    sbx = Sandbox.create()
    for _ in range(args.warmup):
        sbx.commands.run(args.cmd, user=args.user)

    samples = []
    t_all = time.perf_counter()
    for _ in range(args.n):
        t0 = time.perf_counter()
        r = sbx.commands.run(args.cmd, user=args.user)
        samples.append((time.perf_counter() - t0) * 1000)
        if r.exit_code != 0:
            print(f"unexpected exit code {r.exit_code}", file=sys.stderr)
            return 1
    total = time.perf_counter() - t_all
    s = sorted(samples)
    print(f"commands.run({args.cmd!r}) against envd (debug mode), {args.n} calls, {args.warmup} warm-up")
    print(f"  p50  {percentile(s, 50):8.2f} ms")
    print(f"  p90  {percentile(s, 90):8.2f} ms")
    print(f"  p99  {percentile(s, 99):8.2f} ms")
    print(f"  max  {s[-1]:8.2f} ms")
    print(f"  mean {statistics.fmean(s):8.2f} ms   ({args.n / total:.0f} calls/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
