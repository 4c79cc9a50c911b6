// Sandbox lifecycle through `cubicle serve` with the official JS SDK (e2b@2.51.0),
// configured only by E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY.
import assert from 'node:assert/strict'
import { after, test } from 'node:test'
import { Sandbox, SandboxNotFoundError } from './e2b.mjs'
import { FAST_TEMPLATE, Tracker, listAll, poll, sleep, uid } from './helpers.mjs'

const t = new Tracker()
after(() => t.cleanup())

const near = (a, b, tolMs = 5000) => Math.abs(a - b) <= tolMs

test('create (base, metadata, envs, timeoutMs) + getInfo', async () => {
  const tag = uid()
  const before = Date.now()
  const sbx = await t.create('base', { metadata: { tag, suite: 'js' }, envs: { JS_ENV: 'js-value' }, timeoutMs: 120_000 })
  assert.match(sbx.sandboxId, /^[a-z0-9]+$/)
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.state, 'running')
  assert.deepEqual(info.metadata, { tag, suite: 'js' })
  assert.ok(info.cpuCount >= 1 && info.memoryMB >= 128, JSON.stringify(info))
  assert.ok(near(info.startedAt.getTime(), before, 10000), String(info.startedAt))
  assert.ok(near(info.endAt.getTime() - info.startedAt.getTime(), 120_000), `${info.startedAt} ${info.endAt}`)
  const r = await sbx.commands.run('echo "$JS_ENV|$E2B_SANDBOX_ID"')
  assert.equal(r.stdout, `js-value|${sbx.sandboxId}\n`)
  const info2 = await Sandbox.getInfo(sbx.sandboxId)
  assert.equal(info2.sandboxId, sbx.sandboxId)
})

test('list: metadata + state filters, pagination', async () => {
  const tag = uid()
  const made = []
  for (let i = 0; i < 3; i++) made.push(await t.create(FAST_TEMPLATE, { metadata: { tag, i: String(i), 'we ird&': 'a=b%c d' } }))
  const ids = new Set(made.map((s) => s.sandboxId))
  const listed = await listAll({ query: { metadata: { tag } } })
  assert.deepEqual(new Set(listed.map((s) => s.sandboxId)), ids)
  for (const s of listed) {
    assert.equal(s.state, 'running')
    assert.equal(s.metadata['we ird&'], 'a=b%c d')
  }
  const one = await listAll({ query: { metadata: { tag, i: '2', 'we ird&': 'a=b%c d' } } })
  assert.deepEqual(one.map((s) => s.sandboxId), [made[2].sandboxId])
  assert.equal((await listAll({ query: { metadata: { tag }, state: ['running'] } })).length, 3)
  assert.equal((await listAll({ query: { metadata: { tag }, state: ['paused'] } })).length, 0)

  const pager = Sandbox.list({ query: { metadata: { tag } }, limit: 2 })
  const p1 = await pager.nextItems()
  assert.equal(p1.length, 2)
  assert.ok(pager.hasNext && pager.nextToken)
  const p2 = await pager.nextItems()
  assert.equal(p2.length, 1)
  assert.equal(pager.hasNext, false)
  assert.deepEqual(new Set([...p1, ...p2].map((s) => s.sandboxId)), ids)
})

test('setTimeout, isRunning, connect, kill, Sandbox.kill(id)', async () => {
  const sbx = await t.create(undefined, { timeoutMs: 60_000 })
  await sbx.setTimeout(30_000)
  let info = await sbx.getInfo()
  assert.ok(near(info.endAt.getTime(), Date.now() + 30_000), String(info.endAt))
  await Sandbox.setTimeout(sbx.sandboxId, 600_000)
  info = await sbx.getInfo()
  assert.ok(near(info.endAt.getTime(), Date.now() + 600_000), String(info.endAt))
  assert.equal(await sbx.isRunning(), true)

  await sbx.files.write('/home/user/js-connect.txt', 'first client')
  const other = await Sandbox.connect(sbx.sandboxId)
  assert.equal(other.sandboxId, sbx.sandboxId)
  assert.equal(await other.files.read('/home/user/js-connect.txt'), 'first client')
  assert.equal((await other.commands.run('echo via-connect')).stdout, 'via-connect\n')

  await sbx.kill()
  assert.equal(await sbx.isRunning(), false)
  await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)

  const s2 = await t.create(FAST_TEMPLATE)
  assert.equal(await Sandbox.kill(s2.sandboxId), true)
  assert.equal(await Sandbox.kill(s2.sandboxId), false)
  assert.ok(!(await listAll()).some((s) => s.sandboxId === s2.sandboxId))
})

test('getMetrics', async () => {
  const sbx = await t.create()
  await sbx.commands.run('head -c 10000000 /dev/urandom | sha256sum >/dev/null')
  const m = await poll(async () => {
    const ms = await sbx.getMetrics()
    return ms.length ? ms : null
  }, 20000, 1000)
  assert.ok(m, 'no metrics within 20 s')
  const last = m[m.length - 1]
  assert.ok(last.cpuCount >= 1)
  assert.ok(last.memTotal > 0 && last.memUsed > 0 && last.memUsed <= last.memTotal, JSON.stringify(last))
  assert.ok(last.diskTotal > 0 && last.diskUsed >= 0, JSON.stringify(last))
  assert.ok(last.timestamp instanceof Date)
})

test('timeout elapsed: isRunning() false, gone from list', { timeout: 120_000 }, async () => {
  const sbx = await t.create(FAST_TEMPLATE, { timeoutMs: 3000 })
  assert.equal(await sbx.isRunning(), true)
  assert.ok(await poll(async () => !(await sbx.isRunning()), 30000, 500), 'still running 30 s after a 3 s timeout')
  await assert.rejects(sbx.getInfo(), SandboxNotFoundError)
  assert.ok(!(await listAll()).some((s) => s.sandboxId === sbx.sandboxId))
  await sleep(10)
})
