"""Latency of the official Python SDK against a running `cubicle serve` (not a test).

Reads E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (as printed by `cubicle serve`) and
measures, over N runs each (default 200, template `base`):

  create                  `Sandbox.create()` (one REST call: POST /v2/sandboxes → 201)
  create+run+kill         `Sandbox.create()` + `commands.run(CMD)` + `kill()`
                          (CMD: `--cmd`, default "echo hi"; the SDK runs it with
                          `/bin/bash -l -c`, so templates without bash, like `tiny`,
                          cannot run it: `--template base --cmd true` is the SDK's
                          counterpart of `cubicle bench cycle --template base`)

and prints p50 / p90 / p99 / max in milliseconds. Sandboxes of the first series are
killed outside the timed region. Run it, e.g., through the e2e launcher:

    sudo tests/e2e/serve/run.sh -- tests/e2e/.venv/bin/python bench/sdk_serve.py [--runs 200] [--template base]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from e2b import Sandbox


def pct(xs, p):
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def report(name, xs):
    ms = [x * 1000 for x in xs]
    print(f"{name:<18} n={len(ms):<4} p50={pct(ms, 50):7.1f} ms  p90={pct(ms, 90):7.1f} ms  "
          f"p99={pct(ms, 99):7.1f} ms  max={max(ms):7.1f} ms  mean={statistics.mean(ms):7.1f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--template", default="base")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cmd", default="echo hi", help='command of the second series (e.g. "true")')
    args = ap.parse_args()
    for v in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        if not os.environ.get(v):
            sys.exit(f"{v} is not set (start `cubicle serve` and use the export lines it prints)")
    print(f"server {os.environ['E2B_API_URL']}, template {args.template}, {args.runs} runs each")

    for _ in range(args.warmup):
        s = Sandbox.create(args.template)
        try:
            s.commands.run(args.cmd)
        finally:  # a failing command (e.g. no bash in the template) leaves nothing running
            s.kill()

    create = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        s = Sandbox.create(args.template)
        create.append(time.perf_counter() - t0)
        s.kill()
    report("create", create)

    full = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        s = Sandbox.create(args.template)
        try:
            r = s.commands.run(args.cmd)
        finally:
            s.kill()
        full.append(time.perf_counter() - t0)
        assert r.exit_code == 0, r
        if args.cmd == "echo hi":
            assert r.stdout == "hi\n", r
    report("create+run+kill", full)


if __name__ == "__main__":
    main()
