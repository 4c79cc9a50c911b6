"""What the cluster suites' Python scripts share: named checks that are counted rather
than stopping the script, its summary and exit status, waiting for a condition, and a
process whose state lives only in its memory (to tell a resume with memory from a
restart)."""

import shlex
import sys
import time

failures = []


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f": {detail}" if detail and not cond else ""), flush=True)
    if not cond:
        failures.append(name)


def finish():
    """Prints how many checks failed (and which), and exits 1 if any did."""
    print(f"{len(failures)} failure(s)" + (": " + ", ".join(failures) if failures else ""), flush=True)
    sys.exit(1 if failures else 0)


def wait_for(pred, secs):
    """Whether `pred()` holds within `secs` seconds (asked every 0.1 s, and once more at the end)."""
    end = time.monotonic() + secs
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


# A process whose state lives only in its memory: a random secret it prints on SIGUSR1.
HOLDER = ("s=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \\n'); echo $s > /tmp/secret.orig; "
          "echo $$ > /tmp/holder.pid; trap 'echo $s > /tmp/secret.dump' USR1; "
          "while :; do sleep 0.1; done")


def secret_dump(sbx):
    """The secret HOLDER (started in `sbx`) holds in its memory now ("" if it does not answer)."""
    sbx.commands.run("rm -f /tmp/secret.dump; kill -USR1 $(cat /tmp/holder.pid)")
    for _ in range(50):
        r = sbx.commands.run("cat /tmp/secret.dump 2>/dev/null || true")
        if r.stdout.strip():
            return r.stdout.strip()
        time.sleep(0.1)
    return ""


def start_holder(sbx):
    """Starts HOLDER in `sbx`, checks it answers, then deletes the secret's only copy on
    disk: from here on the secret is only in memory. Returns (the secret, HOLDER's pid)."""
    sbx.commands.run(f"sh -c {shlex.quote(HOLDER)}", background=True)
    check("holder started", wait_for(lambda: sbx.commands.run("cat /tmp/holder.pid 2>/dev/null || true").stdout.strip() != "", 10))
    orig = sbx.commands.run("cat /tmp/secret.orig").stdout.strip()
    pid = sbx.commands.run("cat /tmp/holder.pid").stdout.strip()
    check("the process answers before the pause", secret_dump(sbx) == orig, orig)
    sbx.commands.run("rm /tmp/secret.orig")
    return orig, pid
