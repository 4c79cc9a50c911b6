"""The official Python SDK's Template builder through an API replica coordinated by the
cluster's database (tests/e2e/cluster/replica_state.sh sets E2B_API_URL, E2B_SANDBOX_URL,
E2B_API_KEY and CUBICLE_*): the build runs on one node, is published to the object store,
a create on the other node pulls it, and a delete removes it everywhere; a volume lives
on one node, sandboxes that mount it are placed there, its content API is relayed."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
from e2b import Sandbox, Template, Volume

STATE = {"a": os.environ["CUBICLE_STATE_A"], "b": os.environ["CUBICLE_STATE_B"]}
BUCKET = os.environ["CUBICLE_BUCKET_DIR"]
BIN = os.environ["CUBICLE_BIN"]
DB = os.environ["CUBICLE_E2E_DB"]
TOKEN_FILE = os.environ["CUBICLE_NODE_TOKEN_FILE"]
API = os.environ["E2B_API_URL"].rstrip("/")
API2 = os.environ["CUBICLE_API2"].rstrip("/")  # the second replica
HEADERS = {"X-API-KEY": os.environ["E2B_API_KEY"]}
failures = []


def kill_all(sandboxes):
    """Kills what a section made, whatever happened in it (a failed check included)."""
    for s in sandboxes:
        try:
            s.kill()
        except Exception:  # noqa: BLE001 - best effort: the leftover checks catch the rest
            pass


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f": {detail}" if detail and not cond else ""))
    if not cond:
        failures.append(name)


def where(sid):
    hits = [n for n, s in STATE.items() if os.path.isdir(os.path.join(s, "sandboxes", sid))]
    return hits[0] if len(hits) == 1 else f"?{hits}"


def has_template(node, name):
    return os.path.isfile(os.path.join(STATE[node], "templates", name, "template.json"))


def drain(node, cancel=False, strict=True):
    """Marks `node` draining (its running sandboxes paused). Not `strict`: a sandbox
    killed a moment ago that the drain could not pause any more is not an error."""
    cmd = [BIN, "node", "drain", node, "--database", DB, "--node-token-file", TOKEN_FILE]
    r = subprocess.run(cmd + (["--cancel"] if cancel else []), capture_output=True, text=True)
    if r.returncode != 0 and (strict or f"node {node}: draining" not in r.stdout):
        raise RuntimeError(f"{' '.join(cmd)}: {r.stdout} {r.stderr}")


name = f"e2e-cluster-{uuid.uuid4().hex[:8]}"
made = []
try:
    logs = []
    t0 = time.monotonic()
    # A COPY step: its archive is uploaded to the URL the replica hands out (it names the
    # build node, so any replica relays the upload there).
    ctx = tempfile.mkdtemp(prefix="cubicle-replica-state-ctx-")
    with open(os.path.join(ctx, "copied.txt"), "w") as f:
        f.write(f"copied {name}\n")
    tpl = (
        Template(file_context_path=ctx)
        .from_template("tiny")
        .copy("copied.txt", "/copied.txt", user="root")
        .run_cmd(f"echo cluster-built > /marker # {name}", user="root")
    )
    Template.build(tpl, name, on_build_logs=lambda e: logs.append(str(e)))
    build_s = time.monotonic() - t0
    print(f"     built {name} through the replica in {build_s:.1f} s")
    builders = [n for n in STATE if has_template(n, name)]
    check("the template was built on exactly one node", len(builders) == 1, str(builders))
    builder = builders[0] if builders else "a"
    other = "b" if builder == "a" else "a"
    check("its manifest is in the object store",
          os.path.isfile(os.path.join(BUCKET, "templates", f"{name}.json")))
    check("the build log says it was published",
          any("published to the object store" in l for l in logs), "\n".join(logs[-5:]))

    for api in (API, API2):
        r = httpx.get(f"{api}/templates", headers=HEADERS)
        check(f"GET /templates lists it ({api})", r.status_code == 200
              and any(t.get("templateID") == name for t in r.json()), r.text[:300])
        r = httpx.get(f"{api}/templates/aliases/{name}", headers=HEADERS)
        check(f"its alias is known ({api})", r.status_code == 200, r.text[:200])
    r = httpx.get(f"{API2}/templates/{name}", headers=HEADERS)
    check("the other replica shows its builds", r.status_code == 200
          and r.json().get("builds", [{}])[0].get("status") == "ready", r.text[:300])

    s1 = Sandbox.create(name, timeout=120)
    made.append(s1)
    check("a create from it works", s1.files.read("/marker").strip() == "cluster-built")
    check("the COPY step's file is there", s1.files.read("/copied.txt") == f"copied {name}\n")
    shutil.rmtree(ctx, ignore_errors=True)
    n1 = where(s1.sandbox_id)
    print(f"     first sandbox on node {n1} (built on {builder})")

    # Force the next create elsewhere: drain the node the first one runs on.
    drain(n1)
    time.sleep(1.5)
    t1 = time.monotonic()
    s2 = Sandbox.create(name, timeout=120)
    made.append(s2)
    n2 = where(s2.sandbox_id)
    print(f"     second sandbox on node {n2} in {(time.monotonic() - t1) * 1000:.0f} ms")
    check("the second create lands on the other node", n2 != n1 and n2 in STATE, f"{n1} {n2}")
    check("the files built on one node are there on the other",
          s2.files.read("/marker").strip() == "cluster-built"
          and s2.files.read("/copied.txt") == f"copied {name}\n")
    check("the other node has the template now", has_template(n2, name))
    drain(n1, cancel=True)

    r = httpx.delete(f"{API}/templates/{name}", headers=HEADERS)
    check("a delete is refused while sandboxes use it", r.status_code == 400, r.text[:200])
    for s in made:
        s.kill()
    made.clear()
    time.sleep(1.0)  # the replica's view of the nodes (polled every 500 ms)
    r = httpx.delete(f"{API2}/templates/{name}", headers=HEADERS)
    check("the delete through the other replica succeeds", r.status_code == 204, r.text[:300])
    check("gone from both nodes", not has_template("a", name) and not has_template("b", name))
    check("gone from the object store",
          not os.path.exists(os.path.join(BUCKET, "templates", f"{name}.json")))
    r = httpx.get(f"{API}/templates/aliases/{name}", headers=HEADERS)
    check("its name is forgotten", r.status_code == 404, r.text[:200])
    try:
        s = Sandbox.create(name, timeout=30)
        made.append(s)
        check("a create from the deleted template fails", False)
    except Exception as e:  # noqa: BLE001 - the SDK's NotFound or its wrapper
        check("a create from the deleted template fails", "not found" in str(e).lower(), str(e))
finally:
    kill_all(made)


# ---- volumes ----
made = []
vol = None
try:
    vol = Volume.create(f"e2e-{uuid.uuid4().hex[:8]}")
    check("a volume is created through the replica", bool(vol.volume_id))
    a = Sandbox.create("tiny", volume_mounts={"/mnt/v": vol}, timeout=120)
    made.append(a)
    a.files.write("/mnt/v/hello.txt", "from-a")
    node = where(a.sandbox_id)
    vol.write_file("/api.txt", "via-content-api")
    b = Sandbox.create("tiny", volume_mounts={"/data": vol.name}, timeout=120)
    made.append(b)
    check("the second sandbox is placed on the volume's node", where(b.sandbox_id) == node,
          f"{where(b.sandbox_id)} vs {node}")
    check("it reads what the first wrote", b.files.read("/data/hello.txt") == "from-a")
    check("it reads what the content API wrote", b.files.read("/data/api.txt") == "via-content-api")
    b.files.write("/data/from-b.txt", "from-b")
    check("the content API reads what a sandbox wrote", vol.read_file("/from-b.txt") == "from-b")
    check("the volume is listed", any(v.volume_id == vol.volume_id for v in Volume.list()))
    for s in made:
        s.kill()
    made.clear()
    drain(node, strict=False)
    time.sleep(1.5)
    try:
        s = Sandbox.create("tiny", volume_mounts={"/data": vol.name}, timeout=60)
        made.append(s)
        check("a create mounting a volume of a draining node is refused", False)
    except Exception as e:  # noqa: BLE001
        check("a create mounting a volume of a draining node is refused",
              "draining" in str(e), str(e))
    drain(node, cancel=True)
    time.sleep(1.5)
    check("the volume is deleted through the replica", Volume.destroy(vol.volume_id) is True)
    vid, vol = vol.volume_id, None
    check("it is gone", all(v.volume_id != vid for v in Volume.list()))
finally:
    kill_all(made)
    if vol is not None:
        try:
            Volume.destroy(vol.volume_id)
        except Exception:  # noqa: BLE001
            pass

if failures:
    print(f"replica-state-e2e: {len(failures)} check(s) failed: {failures}")
    sys.exit(1)
print("replica-state-e2e: all checks passed")
