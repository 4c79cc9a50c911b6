"""Builds the private "internet" the network tests talk to, from inside the test run's
own network namespace (run.sh's `unshare --net`, where `cubicle serve` runs too):

  serve's namespace ── veth inet0 (100.127.255.1/30) ──  "internet" namespace
                       default route → 100.127.255.2      100.127.255.2 on eth0, and on lo:
                                                           203.0.113.10  allowed.test, www.allowed.test
                                                           203.0.113.20  evil.test
                                                           203.0.113.30  other.test (no DNS name used)
                                                           203.0.113.53  DNS server
                                                           203.0.113.80  SOCKS5 proxy (socks.test)
                                                           203.0.113.25  SMTP
                                                           168.63.129.16 a "cloud control" address

The addresses exist only in that namespace; the serve namespace has no other way out, so
no test packet can leave the machine. Certificates come from a throwaway CA made with
`openssl` for this run.

    python netlab.py up        prints one JSON line (addresses, CA PEM, log paths), keeps
                               the lab up until its stdin closes, then tears it down
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LINK = "inet0"  # must not start with the sandbox veth prefix (cbs)
HOST_SIDE, INET_SIDE = "100.127.255.1", "100.127.255.2"
ALLOWED, EVIL, OTHER = "203.0.113.10", "203.0.113.20", "203.0.113.30"
DNS, SOCKS, SMTP, CONTROL = "203.0.113.53", "203.0.113.80", "203.0.113.25", "168.63.129.16"
NAMES = {
    "allowed.test": ALLOWED,
    "www.allowed.test": ALLOWED,
    "api.allowed.test": ALLOWED,
    "evil.test": EVIL,
    "socks.test": SOCKS,
}


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True)


def make_certs(d: str) -> tuple[str, str, str]:
    ca_key, ca, key, csr, crt = (os.path.join(d, n) for n in ("ca.key", "ca.pem", "leaf.key", "leaf.csr", "leaf.pem"))
    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
       "-days", "2", "-subj", "/CN=cubicle test CA")
    sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=allowed.test")
    ext = os.path.join(d, "ext.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=" + ",".join(f"DNS:{n}" for n in list(NAMES) + ["*.allowed.test"]) + "\n")
    sh("openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", crt,
       "-days", "2", "-extfile", ext)
    return ca, crt, key


class Lab:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="cubicle-netlab-")
        self.holder: subprocess.Popen | None = None
        self.server: subprocess.Popen | None = None
        self.added_default = False

    def up(self) -> dict:
        ca, crt, key = make_certs(self.dir)
        self.holder = subprocess.Popen(["unshare", "--net", "sleep", "infinity"])
        me = os.readlink("/proc/self/ns/net")
        ns = f"/proc/{self.holder.pid}/ns/net"
        for _ in range(200):
            try:
                if os.readlink(ns) != me:
                    break
            except OSError:
                pass
            time.sleep(0.01)
        inside = ["nsenter", f"--net={ns}"]
        sh("ip", "link", "del", LINK, check=False)
        sh("ip", "link", "add", LINK, "type", "veth", "peer", "name", "eth0", "netns", str(self.holder.pid))
        sh("ip", "addr", "add", f"{HOST_SIDE}/30", "dev", LINK)
        sh("ip", "link", "set", LINK, "up")
        if not sh("ip", "-4", "route", "show", "default").stdout.strip():
            sh("ip", "route", "add", "default", "via", INET_SIDE, "dev", LINK)
            self.added_default = True
        sh(*inside, "ip", "link", "set", "lo", "up")
        sh(*inside, "ip", "addr", "add", f"{INET_SIDE}/30", "dev", "eth0")
        sh(*inside, "ip", "link", "set", "eth0", "up")
        for a in [ALLOWED, EVIL, OTHER, DNS, SOCKS, SMTP, CONTROL]:
            sh(*inside, "ip", "addr", "add", f"{a}/32", "dev", "lo")
        config = {
            "log_dir": self.dir,
            "names": NAMES,
            "web": [ALLOWED, EVIL, OTHER],
            "dns_ip": DNS,
            "socks_ip": SOCKS,
            "smtp_ip": SMTP,
            "cert": crt,
            "key": key,
        }
        self.server = subprocess.Popen(
            [*inside, sys.executable, os.path.join(HERE, "internet.py"), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.server.stdout.readline() if self.server.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"the lab's servers did not start: {line!r}")
        with open(ca) as f:
            ca_pem = f.read()
        # The egress proxy verifies the servers behind header rules against this CA
        # too (run.sh points `serve --egress-upstream-ca` at the path).
        upstream_ca = os.environ.get("CUBICLE_EGRESS_UPSTREAM_CA")
        if upstream_ca:
            shutil.copyfile(ca, upstream_ca)
        return {
            "allowed": ALLOWED,
            "evil": EVIL,
            "other": OTHER,
            "dns": DNS,
            "socks": SOCKS,
            "smtp": SMTP,
            "control": CONTROL,
            "names": NAMES,
            "ca_pem": ca_pem,
            "dns_log": os.path.join(self.dir, "dns.log"),
            "socks_log": os.path.join(self.dir, "socks.log"),
        }

    def down(self) -> None:
        for p in (self.server, self.holder):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if self.added_default:
            sh("ip", "route", "del", "default", "via", INET_SIDE, check=False)
        sh("ip", "link", "del", LINK, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> None:
    if sys.argv[1:] != ["up"]:
        sys.exit("usage: netlab.py up")
    lab = Lab()
    try:
        print(json.dumps(lab.up()), flush=True)
        sys.stdin.read()
    finally:
        lab.down()


if __name__ == "__main__":
    main()
