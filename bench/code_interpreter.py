"""Latency of `e2b_code_interpreter` against a running `cubicle serve` (not a test).

Reads E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (as printed by `cubicle serve`) and
measures on the `code-interpreter-v1` template:

  run_code("1+1")         round trip through the router, N runs (default 500) in one
                          sandbox after a warm-up
  create→first result     `Sandbox.create()` + the first `run_code("1+1")`, M runs
                          (default 10; each sandbox killed outside the timed region,
                          then `--pace` seconds of pause, so that a warm pool refills:
                          run the server with `--pool code-interpreter-v1=N`)

and prints p50 / p90 / p99 / max in milliseconds, and the CPU time per `run_code("1+1")`
of the Python kernel process (all its threads: `os.times()` in the kernel) and of
`cubicle-interpreter` (its parent: `/proc/<ppid>/stat`) over the timed runs. Run it through the e2e launcher:

    sudo tests/e2e/serve/run.sh -- tests/e2e/.venv/bin/python bench/code_interpreter.py [--runs 500] [--creates 10] [--pace 3]

(run.sh runs the server with `--pool code-interpreter-v1=2` unless CUBICLE_E2E_SERVE_ARGS says otherwise).
"""

from __future__ import annotations

import argparse
import time

from e2b_code_interpreter import Sandbox

TEMPLATE = "code-interpreter-v1"


def pct(xs, p):
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def report(name, xs):
    print(
        f"{name:<24} n={len(xs):<4} p50={pct(xs, 50):8.1f}  p90={pct(xs, 90):8.1f}  "
        f"p99={pct(xs, 99):8.1f}  max={max(xs):8.1f}  (ms)"
    )


# Run in the kernel: its own CPU seconds and its parent's (the interpreter), and its kind.
CPU_PROBE = """
import os as __o
__t = __o.times()
__s = open(f"/proc/{__o.getppid()}/stat").read().rsplit(")", 1)[1].split()
(__t.user + __t.system, (int(__s[11]) + int(__s[12])) / __o.sysconf("SC_CLK_TCK"), type(get_ipython()).__module__)
"""


def cpu(s):
    return eval(s.run_code(CPU_PROBE).text)  # noqa: S307 - a tuple literal from our own probe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--creates", type=int, default=10)
    ap.add_argument("--pace", type=float, default=0.0, help="seconds between creates")
    a = ap.parse_args()

    # Make sure the template is built (the first create may build it).
    s = Sandbox.create(TEMPLATE, request_timeout=1200)
    try:
        for _ in range(20):
            assert s.run_code("1+1").text == "2"
        rt = []
        k0, i0, kind = cpu(s)
        for _ in range(a.runs):
            t0 = time.perf_counter()
            ex = s.run_code("1+1")
            rt.append((time.perf_counter() - t0) * 1000)
            assert ex.text == "2"
        k1, i1, _ = cpu(s)
    finally:
        s.kill()
    if rt:
        report('run_code("1+1")', rt)
        n = len(rt) + 1
        print(f"CPU per run_code: kernel ({kind}) {(k1 - k0) / n * 1000:.2f} ms, interpreter {(i1 - i0) / n * 1000:.2f} ms")

    cf = []
    for _ in range(a.creates):
        t0 = time.perf_counter()
        s = Sandbox.create(TEMPLATE)
        try:
            ex = s.run_code("1+1")
            cf.append((time.perf_counter() - t0) * 1000)
            assert ex.text == "2"
        finally:
            s.kill()
        time.sleep(a.pace)
    if cf:
        report("create→first result", cf)


if __name__ == "__main__":
    main()
