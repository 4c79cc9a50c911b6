"""What the cluster suites' Python scripts share: named checks that are counted rather
than stopping the script, its summary and exit status, and a process whose state lives
only in its memory (to tell a resume with memory from a restart)."""

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
