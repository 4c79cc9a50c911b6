"""Pauses of a sandbox that starts processes all the time (not a test): a `base` sandbox
runs `sh -c 'while :; do sleep 0.1; done'` and `sh -c 'while :; do /bin/true; done'` in
the background (Debian's `dash` starts each command with `vfork`), then is paused and
connected again `--cycles` times through the official Python SDK. Prints how many pauses
succeeded, their p50 and max, and each failure with how long it took.

Against a running `cubicle serve` (E2B_API_URL, E2B_API_KEY as it prints them), e.g.:

  tests/e2e/serve/run.sh -- tests/e2e/.venv/bin/python bench/pause_busy.py --cycles 40

Exits 1 when a pause failed."""

import argparse
import sys
import time

from e2b import Sandbox

ap = argparse.ArgumentParser()
ap.add_argument("--cycles", type=int, default=40)
ap.add_argument("--template", default="base")
args = ap.parse_args()

sbx = Sandbox.create(args.template, timeout=600)
times, fails = [], []
try:
    sbx.commands.run("sh -c 'while :; do sleep 0.1; done' > /dev/null 2>&1", background=True, timeout=0)
    sbx.commands.run("sh -c 'while :; do /bin/true; done' > /dev/null 2>&1", background=True, timeout=0)
    time.sleep(0.5)
    for i in range(args.cycles):
        t = time.monotonic()
        try:
            sbx.pause()
            times.append(time.monotonic() - t)
        except Exception as e:  # noqa: BLE001 (a failed pause is what this counts)
            fails.append(f"{i}: after {time.monotonic() - t:.1f} s: {str(e).splitlines()[0]}")
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert sbx.commands.run("echo ok").stdout.strip() == "ok"
finally:
    sbx.kill()
times.sort()
print(f"{len(times)} of {args.cycles} pauses succeeded with processes starting"
      + (f": p50 {1000 * times[len(times) // 2]:.0f} ms, max {1000 * times[-1]:.0f} ms" if times else ""))
for f in fails:
    print("  failed", f)
sys.exit(1 if fails else 0)
