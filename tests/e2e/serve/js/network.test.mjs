// Network policy with the official JS SDK (e2b@2.51.0): network options on create,
// updateNetwork, domain rules against the usual bypasses, the egress proxy, options
// refused by name. Destinations are the private internet of ../netlab (addresses that
// exist only in this run's network namespaces). A "blocked" result must be the rules
// answering: a refusal or reset within 1.5 s, never a timeout.
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { createInterface } from 'node:readline'
import { after, before, test } from 'node:test'
import { fileURLToPath } from 'node:url'
import { createHash, randomBytes } from 'node:crypto'
import { Sandbox, Secret } from './e2b.mjs'
import { API_KEY, API_URL, TEMPLATE, Tracker, singleHost } from './helpers.mjs'

const NEEDS_NETLAB = singleHost("netlab's private internet is in the suite's network namespace, the cluster's nodes in their own")

const t = new Tracker()
const PY = fileURLToPath(new URL('../../.venv/bin/python', import.meta.url))
const NETLAB = fileURLToPath(new URL('../netlab/netlab.py', import.meta.url))
let lab
let labProc

before(async () => {
  labProc = spawn(PY, [NETLAB, 'up'], { stdio: ['pipe', 'pipe', 'inherit'] })
  const rl = createInterface({ input: labProc.stdout })
  const line = await new Promise((resolve, reject) => {
    rl.once('line', resolve)
    labProc.once('exit', (c) => reject(new Error(`netlab exited (${c})`)))
  })
  lab = JSON.parse(line)
})

after(async () => {
  await t.cleanup()
  if (labProc) {
    labProc.stdin.end()
    await new Promise((r) => labProc.once('exit', r))
  }
})

// A TCP/TLS probe run with the sandbox's python3: {ok, data|error, secs}.
const PROBE = `
import json, socket, ssl, sys, time
host, port, name, tls = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "tls"
t = time.time()
try:
    s = socket.create_connection((host, port), timeout=5)
    if tls:
        s = ssl.create_default_context(cafile="/tmp/ca.pem").wrap_socket(s, server_hostname=name)
    s.sendall(f"GET / HTTP/1.1\\r\\nHost: {name}\\r\\nConnection: close\\r\\n\\r\\n".encode())
    d = b""
    while True:
        c = s.recv(65536)
        if not c: break
        d += c
    print(json.dumps({"ok": True, "data": d.decode(errors="replace"), "secs": time.time() - t}))
except Exception as e:
    print(json.dumps({"ok": False, "error": str(e), "secs": time.time() - t}))
`

async function box(opts) {
  const sbx = await t.create(TEMPLATE, { timeoutMs: 300_000, ...opts })
  await sbx.files.write('/tmp/probe.py', PROBE)
  await sbx.files.write('/tmp/ca.pem', lab.ca_pem)
  return sbx
}

async function probe(sbx, host, port, name, tls = false) {
  const r = await sbx.commands.run(`python3 /tmp/probe.py ${host} ${port} ${name} ${tls ? 'tls' : 'plain'}`)
  return JSON.parse(r.stdout)
}

function reached(r, server) {
  assert.ok(r.ok, JSON.stringify(r))
  const body = JSON.parse(r.data.split('\r\n\r\n')[1])
  assert.equal(body.server, server, r.data)
  return body
}

function refused(r, what) {
  assert.ok(!r.ok || r.data === '', `${what}: got through: ${JSON.stringify(r)}`)
  assert.ok(r.secs < 1.5, `${what}: failed only after ${r.secs} s (not the rules answering)`)
}

test('allowOut / denyOut addresses, getInfo echoes the network', NEEDS_NETLAB, async () => {
  const sbx = await box({ network: { allowOut: [lab.allowed], denyOut: ['0.0.0.0/0'] } })
  reached(await probe(sbx, lab.allowed, 80, lab.allowed), lab.allowed)
  refused(await probe(sbx, lab.evil, 80, lab.evil), 'outside allowOut')
  const info = await sbx.getInfo()
  assert.deepEqual(info.network?.allowOut, [lab.allowed], JSON.stringify(info))
  assert.deepEqual(info.network?.denyOut, ['0.0.0.0/0'])
})

test('domains: allowed by name, bypasses contained, updateNetwork replaces', NEEDS_NETLAB, async () => {
  const network = { allowOut: ['allowed.test', '*.allowed.test'], denyOut: ['0.0.0.0/0'], dnsServers: [lab.dns] }
  const sbx = await box({ network })
  reached(await probe(sbx, lab.allowed, 443, 'www.allowed.test', true), lab.allowed)
  const curl = await sbx.commands.run('curl -sS --max-time 5 http://allowed.test/')
  assert.match(curl.stdout, new RegExp(lab.allowed.replaceAll('.', '\\.')))
  // The right name at the wrong address, and the wrong name at the right address.
  refused(await probe(sbx, lab.evil, 443, 'allowed.test', true), 'SNI allowed.test at evil')
  refused(await probe(sbx, lab.evil, 80, 'allowed.test'), 'Host allowed.test at evil')
  refused(await probe(sbx, lab.allowed, 80, 'evil.test'), 'Host evil.test at allowed')
  // A name outside the policy does not resolve, and the question never leaves the node.
  const dig = await sbx.commands.run('getent hosts exfil-1234.evil.test || echo unresolved')
  assert.match(dig.stdout, /unresolved/)
  assert.ok(!readFileSync(lab.dns_log, 'utf8').includes('exfil-1234'), 'the refused question reached the DNS server')
  // Live update (replace): evil.test allowed now, allowed.test no longer.
  const t0 = Date.now()
  await sbx.updateNetwork({ allowOut: ['evil.test'], denyOut: ['0.0.0.0/0'], dnsServers: [lab.dns] })
  const took = Date.now() - t0
  assert.ok(took < 1000, `updateNetwork took ${took} ms`)
  reached(await probe(sbx, lab.evil, 80, 'evil.test'), lab.evil)
  refused(await probe(sbx, lab.allowed, 80, 'allowed.test'), 'removed by the update')
  const info = await Sandbox.getInfo(sbx.sandboxId)
  assert.deepEqual(info.network?.allowOut, ['evil.test'])
  // allowInternetAccess: false is "deny everything not allowed".
  await sbx.updateNetwork({ allowInternetAccess: false, allowOut: [lab.other] })
  reached(await probe(sbx, lab.other, 80, lab.other), lab.other)
  refused(await probe(sbx, lab.evil, 80, lab.evil), 'internet off')
})

test('egressProxy: tunnelled through SOCKS5 with credentials, fails closed', NEEDS_NETLAB, async () => {
  const sbx = await box({ network: { egressProxy: { address: `${lab.socks}:1080`, username: 'user', password: 'pass' } } })
  const body = reached(await probe(sbx, lab.other, 80, lab.other), lab.other)
  assert.equal(body.client, lab.socks, 'the connection did not come through the proxy')
  await sbx.updateNetwork({ egressProxy: { address: `${lab.socks}:1080`, username: 'user', password: 'wrong' } })
  const r = await probe(sbx, lab.other, 80, lab.other)
  assert.ok(!r.ok || r.data === '', JSON.stringify(r))
  await assert.rejects(
    Sandbox.create(TEMPLATE, { network: { egressProxy: { address: '10.9.9.9:1080' } } }),
    /egress proxy/i,
  )
})

test('options Cubicle cannot honour are refused by name', async () => {
  await assert.rejects(Sandbox.create(TEMPLATE, { network: { httpsPorts: [3000] } }), /httpsPorts/)
  await assert.rejects(
    Sandbox.create(TEMPLATE, {
      network: {
        allowOut: ['x.test'],
        denyOut: ['0.0.0.0/0'],
        rules: { 'x.test': [{ transform: { headers: { Host: 'y.test' } } }] },
      },
    }),
    /network\.rules/,
  )
  await assert.rejects(Sandbox.create(TEMPLATE, { network: { allowOut: ['x.test'] } }), /ALL_TRAFFIC/)
})

test('the audit trail is in the logs API', async () => {
  const sbx = await box({ network: { allowOut: ['allowed.test'], denyOut: ['0.0.0.0/0'], dnsServers: [lab.dns] } })
  await sbx.commands.run('curl -sS --max-time 5 http://allowed.test/ >/dev/null; curl -sS --max-time 5 http://evil.test/ >/dev/null; true')
  const r = await fetch(`${API_URL}/v2/sandboxes/${sbx.sandboxId}/logs?limit=1000`, { headers: { 'X-API-KEY': API_KEY } })
  assert.equal(r.status, 200)
  const { logs } = await r.json()
  const net = logs.filter((l) => l.fields?.logger === 'network').map((l) => l.message)
  assert.ok(net.some((m) => m.includes('dns A allowed.test')), net.join('\n'))
  assert.ok(net.some((m) => m.includes('evil.test') && m.includes('denied')), net.join('\n'))
})

test('header rules put a secret into HTTP and HTTPS requests, never into the sandbox', NEEDS_NETLAB, async () => {
  const value = `clear-js-${randomBytes(16).toString('hex')}`
  const name = `e2e-js-rule-${randomBytes(4).toString('hex')}`
  const want = createHash('sha256').update(`Bearer ${value}`).digest('hex')
  const info = await Secret.create(name, value)
  try {
    const sbx = await box({
      network: {
        rules: { 'allowed.test': [{ transform: { headers: { Authorization: `Bearer ${Secret.fill(name)}` } } }] },
      },
    })
    for (const url of ['http://allowed.test/echo', 'https://allowed.test/echo']) {
      const r = await sbx.commands.run(`curl -sS ${url}`)
      assert.equal(JSON.parse(r.stdout).authorization_sha256, want, `${url}: ${r.stdout}`)
    }
    // The value is in no file and no process environment of the sandbox.
    const r = await sbx.commands.run(
      `grep -rIlF '${value}' / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev 2>/dev/null; ` +
        `cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -cF '${value}'; true`,
    )
    assert.ok(!r.stdout.includes(value), r.stdout)
    assert.equal(r.stdout.trim(), '0')
  } finally {
    await Secret.destroy(info.secretId)
  }
})
