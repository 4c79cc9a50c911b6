// E2B fidelity (issue 20) with the official JS SDK: relative paths and cwd-less commands
// follow the requested user's home (files, watchDir, signed URLs); getMetrics({start,
// end}) answers from a sampled history and the batch route with the latest sample; the
// base template behaves like E2B's base image (python is Python 3, pip, compilers,
// yarn…); directory sizes are the filesystem's; getHost(port) with serve's default
// domain resolves here and reaches a server in the sandbox without routing headers.
import assert from 'node:assert/strict'
import { lookup } from 'node:dns/promises'
import { after, before, test } from 'node:test'
import { ApiClient, CommandExitError, ConnectionConfig, FilesystemEventType as ET, Sandbox } from './e2b.mjs'
import { API_URL, DOMAIN, Tracker, poll, uid } from './helpers.mjs'

const t = new Tracker()
let sbx
before(async () => {
  sbx = await t.create('base', { timeoutMs: 600_000 })
})
after(() => t.cleanup())

// ---- 1. relative paths follow the requested user -------------------------------------

test('relative paths follow the requested user', async () => {
  const n = uid()
  const info = await sbx.files.write(`rel-${n}.txt`, 'as root', { user: 'root' })
  assert.equal(info.path, `/root/rel-${n}.txt`)
  assert.equal((await sbx.commands.run(`stat -c %U /root/rel-${n}.txt`, { user: 'root' })).stdout, 'root\n')
  assert.equal(await sbx.files.read(`rel-${n}.txt`, { user: 'root' }), 'as root')
  assert.equal((await sbx.files.getInfo(`rel-${n}.txt`, { user: 'root' })).path, `/root/rel-${n}.txt`)
  assert.equal(await sbx.files.exists(`rel-${n}.txt`), false)
  assert.equal((await sbx.files.write(`rel-${n}.txt`, 'as user')).path, `/home/user/rel-${n}.txt`)

  assert.equal(await sbx.files.makeDir(`d-${n}/sub`, { user: 'root' }), true)
  const listed = (await sbx.files.list(`d-${n}`, { user: 'root' })).map((e) => e.path)
  assert.deepEqual(listed, [`/root/d-${n}/sub`])
  const moved = await sbx.files.rename(`d-${n}/sub`, `d-${n}/moved`, { user: 'root' })
  assert.equal(moved.path, `/root/d-${n}/moved`)
  await sbx.files.remove(`d-${n}/moved`, { user: 'root' })
  assert.equal((await sbx.commands.run(`ls -A /root/d-${n}`, { user: 'root' })).stdout, '')
  assert.equal(await sbx.files.exists(`d-${n}`, { user: 'root' }), true)
  assert.equal(await sbx.files.exists(`d-${n}`), false)
})

test('watchDir on a relative path follows the user', async () => {
  const d = `w-${uid()}`
  await sbx.files.makeDir(d, { user: 'root' })
  const events = []
  const h = await sbx.files.watchDir(d, (e) => events.push(e), { user: 'root' })
  try {
    await sbx.commands.run(`echo x > /root/${d}/seen.txt`, { user: 'root' })
    assert.ok(await poll(() => events.some((e) => e.name === 'seen.txt' && e.type === ET.CREATE), 10000), JSON.stringify(events))
  } finally {
    await h.stop()
  }
})

test('commands without cwd start in the user\'s home', async () => {
  assert.equal((await sbx.commands.run('pwd', { user: 'root' })).stdout, '/root\n')
  assert.equal((await sbx.commands.run('pwd')).stdout, '/home/user\n')
})

test('signed URLs resolve relative paths for the user', async () => {
  const n = uid()
  await sbx.commands.run(`echo -n root-file > /root/dl-${n}.txt`, { user: 'root' })
  const dl = await fetch(await sbx.downloadUrl(`dl-${n}.txt`, { user: 'root' }))
  assert.equal(dl.status, 200)
  assert.equal(await dl.text(), 'root-file')
  const form = new FormData()
  form.append('file', new Blob(['uploaded']), 'x.txt')
  const up = await fetch(await sbx.uploadUrl(`ul-${n}/up.txt`, { user: 'root' }), { method: 'POST', body: form })
  assert.equal(up.status, 200, await up.clone().text())
  assert.equal((await up.json())[0].path, `/root/ul-${n}/up.txt`)
  assert.equal((await sbx.commands.run(`stat -c %U:%s /root/ul-${n}/up.txt`, { user: 'root' })).stdout, 'root:8\n')
})

// ---- 2. metrics honour their time range -----------------------------------------------

test('getMetrics: a sampled history and time ranges', { timeout: 120_000 }, async () => {
  const s = await t.create('base', { timeoutMs: 300_000 })
  const created = new Date()
  const ms = await poll(async () => {
    const m = await s.getMetrics()
    return m.length >= 3 ? m : null
  }, 30000, 1000)
  assert.ok(ms, 'fewer than 3 samples within 30 s (one every 5 s expected)')
  const ts = ms.map((m) => m.timestamp.getTime())
  for (let i = 1; i < ts.length; i++) {
    const gap = (ts[i] - ts[i - 1]) / 1000
    assert.ok(gap >= 3 && gap <= 12, `samples every ~5 s, got ${gap} s`)
  }
  const before = await s.getMetrics({ start: new Date(created.getTime() - 3600_000), end: new Date(created.getTime() - 60_000) })
  assert.deepEqual(before, [])
  const one = await s.getMetrics({ start: ms[1].timestamp, end: ms[1].timestamp })
  assert.deepEqual(one.map((m) => m.timestamp.getTime()), [ts[1]])
  assert.deepEqual((await s.getMetrics({ end: ms[1].timestamp })).map((m) => m.timestamp.getTime()), ts.slice(0, 2))
  assert.deepEqual(await s.getMetrics({ start: new Date(Date.now() + 3600_000) }), [])
  const viaClass = await Sandbox.getMetrics(s.sandboxId, { start: ms[0].timestamp, end: ms[ms.length - 1].timestamp })
  assert.deepEqual(viaClass.map((m) => m.timestamp.getTime()), ts)

  // the batch route, through the SDK's own API client: the latest sample
  const client = new ApiClient(new ConnectionConfig())
  const res = await client.api.GET('/sandboxes/metrics', { params: { query: { sandbox_ids: [s.sandboxId, sbx.sandboxId] } } })
  assert.equal(res.response.status, 200)
  const latest = res.data.sandboxes[s.sandboxId]
  assert.ok(latest && latest.timestampUnix * 1000 >= ts[ts.length - 1], JSON.stringify(res.data))
  assert.ok(res.data.sandboxes[sbx.sandboxId], JSON.stringify(res.data))
})

// ---- 3. base template like E2B's base image ------------------------------------------

test('base template: python is Python 3, the usual tools, gcc, pip', { timeout: 240_000 }, async () => {
  const py = await sbx.commands.run('python --version')
  assert.match(py.stdout, /^Python 3\./)
  const tools = 'gcc g++ make git curl wget jq node npm yarn gh sudo socat unzip zip bzip2 xz patch file ssh nc ps ip ping gpg pip'
  assert.equal((await sbx.commands.run(`for t in ${tools}; do command -v $t >/dev/null || echo missing $t; done`)).stdout, '')
  await assert.rejects(
    sbx.commands.run("printf 'int main(void){return 7;}' > /tmp/js7.c && gcc -o /tmp/js7 /tmp/js7.c && /tmp/js7"),
    (e) => e instanceof CommandExitError && e.exitCode === 7,
  )
  const pkg = `/tmp/jspkg-${uid()}`
  await sbx.files.write(`${pkg}/pyproject.toml`, "[build-system]\nrequires=['setuptools']\nbuild-backend='setuptools.build_meta'\n[project]\nname='cubfidjs'\nversion='1.0'\n")
  await sbx.files.write(`${pkg}/cubfidjs.py`, 'X = 43\n')
  const pip = await sbx.commands.run(`pip install --no-index --no-build-isolation ${pkg} 2>&1`, { timeoutMs: 180_000 })
  assert.match(pip.stdout, /Successfully installed cubfidjs/)
  assert.equal((await sbx.commands.run("python -c 'import cubfidjs; print(cubfidjs.X)'", { user: 'root' })).stdout, '43\n')
  assert.equal((await sbx.commands.run('yarn --version')).exitCode, 0)
})

// ---- 4. directory sizes are the filesystem's -------------------------------------------

test('directory sizes are what stat says', async () => {
  const d = `/home/user/jssz-${uid()}`
  await sbx.files.makeDir(`${d}/empty`)
  await sbx.files.write(`${d}/f.txt`, '12345')
  const out = (await sbx.commands.run(`stat -c '%n %s' ${d} ${d}/empty`)).stdout.trim().split('\n')
  const stat = Object.fromEntries(out.map((l) => l.split(' ')).map(([p, s]) => [p, Number(s)]))
  assert.equal((await sbx.files.getInfo(d)).size, stat[d])
  const listed = Object.fromEntries((await sbx.files.list(d)).map((e) => [e.path, e.size]))
  assert.deepEqual(listed, { [`${d}/empty`]: stat[`${d}/empty`], [`${d}/f.txt`]: 5 })
})

// ---- 5. getHost() with the default domain ---------------------------------------------

test('getHost(8000) reaches a server in the sandbox without routing headers', async (ctx) => {
  if (DOMAIN && !DOMAIN.startsWith('localhost')) return ctx.skip(`serve runs with --domain ${DOMAIN}`)
  const apiPort = new URL(API_URL).port
  assert.equal(sbx.sandboxDomain, `localhost:${apiPort}`)
  const host = sbx.getHost(8000)
  assert.equal(host, `8000-${sbx.sandboxId}.localhost:${apiPort}`)
  const name = host.slice(0, host.lastIndexOf(':'))
  const addrs = await lookup(name, { all: true }).catch((e) => {
    throw new Error(`${name} does not resolve here (${e.code}): names under localhost need systemd-resolved or nss-myhostname`)
  })
  assert.ok(addrs.every((a) => a.address === '127.0.0.1' || a.address === '::1'), JSON.stringify(addrs))
  const d = `/tmp/jshost-${uid()}`
  await sbx.files.write(`${d}/index.txt`, 'js via getHost')
  const h = await sbx.commands.run(`cd ${d} && exec python3 -m http.server 8000`, { background: true })
  try {
    const res = await poll(async () => {
      try {
        const r = await fetch(`http://${host}/index.txt`)
        return r.status === 200 ? r : null
      } catch {
        return null
      }
    }, 20000, 300)
    assert.ok(res, `http://${host}/index.txt never answered`)
    assert.equal(await res.text(), 'js via getHost')
    const closed = await fetch(`http://${sbx.getHost(8001)}/`)
    assert.equal(closed.status, 502)
    assert.match((await closed.json()).message, /port is not open/)
  } finally {
    await h.kill()
  }
})
