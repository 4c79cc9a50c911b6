#!/usr/bin/env python3
"""GET /health to every listed sandbox, as `cubicle bench density` does (sequential, one
kept-alive connection, `E2b-Sandbox-Id`), for probing a host that holds N sandboxes
(`cubicle bench density --hold SECS`). Prints the latency distribution and when the slow
requests happened (seconds from the start), to tell periodic stalls from a steady tail.

  health_probe.py HOST PORT IDS_FILE ROUNDS [HEADER:VALUE ...]

IDS_FILE: one sandbox id per line. Extra headers go with every request, e.g.
`cubicle-node-token:<token>` to ask a `cubicle node` directly instead of a replica.
"""
import http.client
import sys
import time


def main():
    host, port, ids_file, rounds = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    extra = [h.split(":", 1) for h in sys.argv[5:]]
    ids = [line.strip() for line in open(ids_file) if line.strip()]
    conn = http.client.HTTPConnection(host, port)
    samples = []
    errors = 0
    start = time.time()
    for _ in range(rounds):
        for sid in ids:
            headers = {"e2b-sandbox-id": sid, "e2b-sandbox-port": "49983"}
            headers.update({k: v for k, v in extra})
            t = time.perf_counter()
            at = time.time() - start
            conn.request("GET", "/health", headers=headers)
            resp = conn.getresponse()
            resp.read()
            ms = (time.perf_counter() - t) * 1000
            if resp.status >= 300:
                errors += 1
                continue
            samples.append((ms, at))
    lat = sorted(ms for ms, _ in samples)
    n = len(lat)
    if n == 0:
        sys.exit(f"no answer (errors: {errors})")
    pick = lambda q: lat[min(n - 1, int(n * q))]
    print(
        f"n={n} errors={errors} p50={pick(0.5):.2f} p95={pick(0.95):.2f} "
        f"p99={pick(0.99):.2f} max={lat[-1]:.2f} ms, {time.time() - start:.1f} s"
    )
    slow = sorted((at, ms) for ms, at in samples if ms > max(5.0, pick(0.99)))
    print("slow (s: ms):", " ".join(f"{at:.2f}:{ms:.0f}" for at, ms in slow[:80]))


if __name__ == "__main__":
    main()
