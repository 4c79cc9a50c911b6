"""The private "internet" of the network tests: servers bound to public-looking addresses
that exist only inside the test's own network namespace (see netlab.py, which starts this
file there). Standard library only.

  DNS       UDP+TCP 53 on DNS_IP: A records for the NAMES below; every question is
            appended to <log dir>/dns.log ("<qtype> <name>")
  web       HTTP 80 and HTTPS 443 (one certificate for every name, from the lab CA; the
            SNI each client sent is reported) on every WEB address:
              GET  /            {"server", "client", "host", "sni", "path"}
              GET  /slow?s=N    1 KiB every 100 ms for N seconds (a long connection)
              POST /sink        reads the body, answers {"bytes": n}
  hold      TCP 9000 on WEB addresses: accepts and keeps connections open
  discard   TCP 9001 on WEB addresses: accepts and closes at once
  smtp      TCP 25 on SMTP_IP: sends a 220 banner
  metadata  HTTP 80 on the cloud control address 168.63.129.16 (answers if reached)
  SOCKS5    on SOCKS_IP: 1080 plain, 1443 inside TLS (certificate for socks.test);
            username/password "user"/"pass" required; every CONNECT is appended to
            <log dir>/socks.log ("CONNECT ip:port")
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import socket
import socketserver
import ssl
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CONFIG = json.loads(sys.argv[1])
LOG_DIR = CONFIG["log_dir"]
NAMES = CONFIG["names"]  # name -> ip
WEB = CONFIG["web"]  # list of ips
DNS_IP = CONFIG["dns_ip"]
SOCKS_IP = CONFIG["socks_ip"]
SMTP_IP = CONFIG["smtp_ip"]
CERT, KEY = CONFIG["cert"], CONFIG["key"]
LOCK = threading.Lock()


def log(name: str, line: str) -> None:
    with LOCK, open(os.path.join(LOG_DIR, name), "a") as f:
        f.write(line + "\n")


# ---- DNS ---------------------------------------------------------------------------


def read_name(m: bytes, pos: int) -> tuple[str, int]:
    labels = []
    while True:
        n = m[pos]
        if n == 0:
            return ".".join(labels).lower(), pos + 1
        labels.append(m[pos + 1 : pos + 1 + n].decode(errors="replace"))
        pos += 1 + n


def dns_answer(q: bytes) -> bytes:
    (qid,) = struct.unpack("!H", q[:2])
    name, end = read_name(q, 12)
    qtype, _ = struct.unpack("!HH", q[end : end + 4])
    log("dns.log", f"{qtype} {name}")
    question = q[12 : end + 4]
    ip = NAMES.get(name)
    if ip is None:
        return struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question  # NXDOMAIN
    if qtype != 1:
        return struct.pack("!HHHHHH", qid, 0x8180, 1, 0, 0, 0) + question  # no data
    rr = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(ip)
    return struct.pack("!HHHHHH", qid, 0x8180, 1, 1, 0, 0) + question + rr


def dns_udp() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((DNS_IP, 53))
    while True:
        q, peer = s.recvfrom(4096)
        try:
            s.sendto(dns_answer(q), peer)
        except Exception:  # noqa: BLE001
            pass


def dns_tcp() -> None:
    s = socket.create_server((DNS_IP, 53), reuse_port=False)
    while True:
        c, _ = s.accept()

        def one(c: socket.socket) -> None:
            with c:
                try:
                    (n,) = struct.unpack("!H", c.recv(2))
                    q = b""
                    while len(q) < n:
                        q += c.recv(n - len(q))
                    a = dns_answer(q)
                    c.sendall(struct.pack("!H", len(a)) + a)
                except Exception:  # noqa: BLE001
                    pass

        threading.Thread(target=one, args=(c,), daemon=True).start()


# ---- web ---------------------------------------------------------------------------

SNI: dict[tuple[str, int], str] = {}


class Web(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        if self.path.startswith("/slow"):
            secs = float(self.path.split("s=")[1]) if "s=" in self.path else 3.0
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            end = time.time() + secs
            while time.time() < end:
                self.wfile.write(b"x" * 1024)
                self.wfile.flush()
                time.sleep(0.1)
            self.close_connection = True
            return
        sock = self.connection
        body = {
            "server": sock.getsockname()[0],
            "client": self.client_address[0],
            "host": self.headers.get("Host"),
            "sni": getattr(sock, "_cubicle_sni", None),
            "path": self.path,
            # What a header rule set, as a digest: the value itself must not travel
            # back into the sandbox (the tests search the sandbox for it).
            "authorization_sha256": hashlib.sha256(self.headers["Authorization"].encode()).hexdigest()
            if self.headers.get("Authorization") is not None else None,
            "authorization_count": len(self.headers.get_all("Authorization") or []),
        }
        self.reply(200, json.dumps(body).encode())

    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("Content-Length", "0"))
        got = 0
        while got < n:
            chunk = self.rfile.read(min(1 << 20, n - got))
            if not chunk:
                break
            got += len(chunk)
        self.reply(200, json.dumps({"bytes": got}).encode())


class TlsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr):
        super().__init__(addr, Web)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(CERT, KEY)

        def on_sni(sslsock, name, _ctx):
            sslsock._cubicle_sni = name  # noqa: SLF001

        ctx.sni_callback = on_sni
        self.ctx = ctx

    def get_request(self):
        sock, addr = self.socket.accept()
        return self.ctx.wrap_socket(sock, server_side=True), addr


class PlainServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr):
        super().__init__(addr, Web)


def serve(server) -> None:
    threading.Thread(target=server.serve_forever, daemon=True).start()


def hold(ip: str) -> None:
    s = socket.create_server((ip, 9000), backlog=1024)
    held = []
    while True:
        c, _ = s.accept()
        held.append(c)


def discard(ip: str) -> None:
    """Port 9001: accepts and closes at once (for connection-rate tests)."""
    s = socket.create_server((ip, 9001), backlog=4096)
    while True:
        c, _ = s.accept()
        c.close()


def smtp() -> None:
    s = socket.create_server((SMTP_IP, 25))
    while True:
        c, _ = s.accept()
        try:
            c.sendall(b"220 smtp.test ready\r\n")
        finally:
            c.close()


# ---- SOCKS5 ------------------------------------------------------------------------


def relay(a: socket.socket, b: socket.socket) -> None:
    socks = [a, b]
    try:
        while True:
            r, _, _ = select.select(socks, [], [], 60)
            if not r:
                return
            for s in r:
                data = s.recv(65536)
                if not data:
                    return
                (b if s is a else a).sendall(data)
    finally:
        a.close()
        b.close()


def recv_exact(c, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = c.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def socks_client(c) -> None:
    try:
        ver, n = recv_exact(c, 2)
        methods = recv_exact(c, n)
        if 2 not in methods:
            c.sendall(b"\x05\xff")
            return
        c.sendall(b"\x05\x02")
        _, ul = recv_exact(c, 2)
        user = recv_exact(c, ul)
        (pl,) = recv_exact(c, 1)
        pw = recv_exact(c, pl)
        if (user, pw) != (b"user", b"pass"):
            c.sendall(b"\x01\x01")
            return
        c.sendall(b"\x01\x00")
        ver, cmd, _, atyp = recv_exact(c, 4)
        if atyp != 1 or cmd != 1:
            c.sendall(b"\x05\x07\x00\x01" + b"\0" * 6)
            return
        ip = socket.inet_ntoa(recv_exact(c, 4))
        (port,) = struct.unpack("!H", recv_exact(c, 2))
        log("socks.log", f"CONNECT {ip}:{port}")
        up = socket.create_connection((ip, port), timeout=5, source_address=(SOCKS_IP, 0))
        up.settimeout(None)
        c.sendall(b"\x05\x00\x00\x01" + socket.inet_aton(SOCKS_IP) + struct.pack("!H", 1080))
        relay(c, up)
    except Exception:  # noqa: BLE001
        try:
            c.close()
        except Exception:  # noqa: BLE001
            pass


def socks(port: int, tls: bool) -> None:
    s = socket.create_server((SOCKS_IP, port), backlog=256)
    ctx = None
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(CERT, KEY)
    while True:
        c, _ = s.accept()
        if ctx is not None:
            try:
                c = ctx.wrap_socket(c, server_side=True)
            except Exception:  # noqa: BLE001
                c.close()
                continue
        threading.Thread(target=socks_client, args=(c,), daemon=True).start()


def main() -> None:
    threads = [dns_udp, dns_tcp, smtp]
    for t in threads:
        threading.Thread(target=t, daemon=True).start()
    for ip in WEB:
        serve(PlainServer((ip, 80)))
        serve(TlsServer((ip, 443)))
        threading.Thread(target=hold, args=(ip,), daemon=True).start()
        threading.Thread(target=discard, args=(ip,), daemon=True).start()
    serve(PlainServer(("168.63.129.16", 80)))
    threading.Thread(target=socks, args=(1080, False), daemon=True).start()
    threading.Thread(target=socks, args=(1443, True), daemon=True).start()
    time.sleep(0.3)
    print("ready", flush=True)
    # Until the harness closes our stdin.
    sys.stdin.read()


if __name__ == "__main__":
    main()
