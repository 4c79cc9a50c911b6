// The data plane through `cubicle serve`'s router with the official JS SDK: commands,
// users, files, PTY, watchDir, a web server reached like getHost(8000), signed URLs
// opened with plain fetch (no routing headers).
import assert from 'node:assert/strict'
import { after, before, test } from 'node:test'
import { CommandExitError, FilesystemEventType as ET } from './e2b.mjs'
import { DOMAIN, SANDBOX_URL, Tracker, poll, uid } from './helpers.mjs'

const t = new Tracker()
let sbx
before(async () => {
  sbx = await t.create('base', { envs: { GLOBAL_JS: 'g' }, timeoutMs: 600_000 })
})
after(() => t.cleanup())
const enc = new TextEncoder()

test('commands: echo, envs, users, exit codes', async () => {
  const r = await sbx.commands.run('echo hi')
  assert.equal(r.stdout, 'hi\n')
  assert.equal(r.exitCode, 0)
  const e = await sbx.commands.run('echo "$GLOBAL_JS|$LOCAL"', { envs: { LOCAL: 'l' } })
  assert.equal(e.stdout, 'g|l\n')
  assert.equal((await sbx.commands.run('whoami')).stdout, 'user\n')
  assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
  await assert.rejects(sbx.commands.run('exit 7'), (err) => err instanceof CommandExitError && err.exitCode === 7)
})

test('files: write, read, list, remove', async () => {
  const d = `/home/user/js-${uid()}`
  await sbx.files.write(`${d}/a.txt`, 'abc')
  await sbx.files.write(`${d}/b.bin`, new Uint8Array([0, 1, 255]).buffer)
  assert.equal(await sbx.files.read(`${d}/a.txt`), 'abc')
  assert.deepEqual([...(await sbx.files.read(`${d}/b.bin`, { format: 'bytes' }))], [0, 1, 255])
  assert.deepEqual((await sbx.files.list(d)).map((e) => e.name).sort(), ['a.txt', 'b.bin'])
  assert.equal(await sbx.files.exists(`${d}/a.txt`), true)
  await sbx.files.remove(d)
  assert.equal(await sbx.files.exists(d), false)
})

test('pty: echo', async () => {
  let out = ''
  const dec = new TextDecoder()
  const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => (out += dec.decode(d, { stream: true })) })
  try {
    await sbx.pty.sendInput(h.pid, enc.encode('echo js-pty-$((6*7))\n'))
    assert.ok(await poll(() => out.includes('js-pty-42'), 15000), out)
  } finally {
    await sbx.pty.kill(h.pid)
  }
})

test('watchDir: an event', async () => {
  const d = `/home/user/jsw-${uid()}`
  await sbx.files.makeDir(d)
  const events = []
  const h = await sbx.files.watchDir(d, (e) => events.push(e))
  try {
    await sbx.files.write(`${d}/n.txt`, 'x')
    assert.ok(await poll(() => events.some((e) => e.name === 'n.txt' && e.type === ET.CREATE), 10000), JSON.stringify(events))
  } finally {
    await h.stop()
  }
})

test('getHost(8000): python3 -m http.server reached through the router', async () => {
  assert.ok(sbx.getHost(8000).startsWith(`8000-${sbx.sandboxId}.`), sbx.getHost(8000))
  const d = `/tmp/jswww-${uid()}`
  await sbx.files.write(`${d}/index.txt`, 'js web')
  const h = await sbx.commands.run(`cd ${d} && exec python3 -m http.server 8000`, { background: true })
  try {
    const headers = { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8000' }
    const res = await poll(async () => {
      const r = await fetch(`${SANDBOX_URL}/index.txt`, { headers })
      return r.status === 200 ? r : null
    }, 20000, 300)
    assert.ok(res, 'http.server never answered')
    assert.equal(await res.text(), 'js web')
    if (DOMAIN) {
      // Host routing: what a browser pointed at getHost(8000) sends
      const { request } = await import('node:http')
      const u = new URL(SANDBOX_URL)
      const body = await new Promise((resolve, reject) => {
        const req = request({ host: u.hostname, port: u.port, path: '/index.txt', headers: { Host: `8000-${sbx.sandboxId}.${DOMAIN}` } }, (r) => {
          let b = ''
          r.on('data', (c) => (b += c))
          r.on('end', () => resolve(`${r.statusCode} ${b}`))
        })
        req.on('error', reject)
        req.end()
      })
      assert.equal(body, '200 js web')
    }
  } finally {
    await h.kill()
  }
})

test('downloadUrl / uploadUrl with plain fetch', async () => {
  const p = `/home/user/jsdl-${uid()}.txt`
  await sbx.files.write(p, 'js download')
  const url = await sbx.downloadUrl(p)
  assert.ok(url.startsWith(`${SANDBOX_URL}/files?`), url)
  let res = await fetch(url)
  assert.equal(res.status, 200, await res.clone().text())
  assert.equal(await res.text(), 'js download')

  const up = `/home/user/jsul-${uid()}/u.txt`
  const form = new FormData()
  form.append('file', new Blob(['js upload']), 'local.txt')
  res = await fetch(await sbx.uploadUrl(up), { method: 'POST', body: form })
  assert.equal(res.status, 200, await res.clone().text())
  assert.equal(await sbx.files.read(up), 'js upload')
})
