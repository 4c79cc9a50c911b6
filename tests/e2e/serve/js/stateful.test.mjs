// Stateful sandboxes through `cubicle serve` with the official JS SDK (e2b@2.51.0):
// pause/connect with memory, filesystem-only pause, auto-pause + auto-resume, snapshots
// (create, list, create from, delete) and fork. What a user sees: a counter held only in a
// process's memory goes on after a resume or in a fork; files are there; ids and tokens
// of forks are their own; the source runs on.
import assert from 'node:assert/strict'
import { after, test } from 'node:test'
import { Sandbox } from './e2b.mjs'
import { Tracker, poll } from './helpers.mjs'

const t = new Tracker()
after(() => t.cleanup())

const COUNTER = `
const http = require('node:http')
let n = 0
http.createServer((q, r) => r.end(\`\${++n} \${process.pid}\`)).listen(Number(process.argv[2]), '127.0.0.1')
`

async function startCounter(sbx, port) {
  await sbx.files.write('/tmp/counter.js', COUNTER)
  // timeoutMs 0: no deadline (envd kills a command at its deadline, 60 s by default).
  await sbx.commands.run(`node /tmp/counter.js ${port}`, { background: true, timeoutMs: 0 })
  const up = await poll(async () => (await sbx.commands.run(`curl -sf localhost:${port} || true`)).stdout.trim(), 20000)
  assert.ok(up, 'the counter server did not start')
}

async function readCounter(sbx, port) {
  const [n, pid] = (await sbx.commands.run(`curl -sf localhost:${port}`)).stdout.trim().split(' ')
  return [Number(n), Number(pid)]
}

const stateOf = async (id) => (await Sandbox.getInfo(id)).state

test('pause, state paused, connect resumes processes and files', async () => {
  const sbx = await t.create('base', { timeoutMs: 300_000 })
  await sbx.files.write('/home/user/js.txt', 'kept')
  await startCounter(sbx, 9101)
  const [n0, pid] = await readCounter(sbx, 9101)
  assert.equal(await sbx.pause(), true)
  assert.equal(await stateOf(sbx.sandboxId), 'paused')
  assert.equal(await sbx.isRunning(), false)
  assert.equal(await sbx.pause(), false, 'a second pause reports it was already paused')
  const paused = await Sandbox.list({ query: { state: ['paused'] } }).nextItems()
  assert.ok(paused.some((s) => s.sandboxId === sbx.sandboxId))
  await sbx.connect({ timeoutMs: 300_000 })
  assert.equal(await stateOf(sbx.sandboxId), 'running')
  assert.deepEqual(await readCounter(sbx, 9101), [n0 + 1, pid])
  assert.equal(await sbx.files.read('/home/user/js.txt'), 'kept')
  const again = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await again.commands.run('echo ok')).stdout, 'ok\n')
})

test('filesystem pause (keepMemory: false) reboots over the same files', async () => {
  const sbx = await t.create('base', { timeoutMs: 300_000 })
  await sbx.files.write('/home/user/fs.txt', 'disk')
  await startCounter(sbx, 9102)
  assert.equal(await sbx.pause({ keepMemory: false }), true)
  await sbx.connect()
  assert.equal(await sbx.files.read('/home/user/fs.txt'), 'disk')
  assert.equal((await sbx.commands.run('curl -sf localhost:9102 || echo gone')).stdout.trim(), 'gone')
})

test('auto-pause at the end time, auto-resume on the next request', async () => {
  const sbx = await t.create('base', { timeoutMs: 4_000, lifecycle: { onTimeout: 'pause', autoResume: true } })
  await sbx.commands.run('echo 6 > /tmp/x')
  const info = await Sandbox.getInfo(sbx.sandboxId)
  assert.deepEqual(info.lifecycle, { onTimeout: 'pause', autoResume: true })
  assert.ok(await poll(async () => (await stateOf(sbx.sandboxId)) === 'paused', 30000), 'not paused at its end time')
  assert.equal((await sbx.commands.run('echo $(( $(cat /tmp/x) * 7 ))')).stdout, '42\n')
  assert.equal(await stateOf(sbx.sandboxId), 'running')
})

test('snapshot: create, list, create a sandbox from it, delete', async () => {
  const sbx = await t.create('base', { timeoutMs: 300_000 })
  await sbx.files.write('/home/user/snap.txt', 'v1')
  await startCounter(sbx, 9103)
  const [n0, pid] = await readCounter(sbx, 9103)
  const snap = await sbx.createSnapshot()
  assert.match(snap.snapshotId, /:default$/)
  assert.equal(await sbx.isRunning(), true)
  const listed = await sbx.listSnapshots().nextItems()
  assert.ok(listed.some((s) => s.snapshotId === snap.snapshotId), JSON.stringify(listed))
  const child = await t.create(snap.snapshotId, { timeoutMs: 120_000 })
  assert.notEqual(child.sandboxId, sbx.sandboxId)
  assert.equal(await child.files.read('/home/user/snap.txt'), 'v1')
  assert.deepEqual(await readCounter(child, 9103), [n0 + 1, pid])
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
})

test('fork: two sandboxes with the parent state, own ids; the parent runs on', async () => {
  const sbx = await t.create('base', { timeoutMs: 300_000 })
  await sbx.files.write('/home/user/fork.txt', 'parent')
  await startCounter(sbx, 9104)
  const [n0, pid] = await readCounter(sbx, 9104)
  const forks = await sbx.fork({ count: 2, timeoutMs: 120_000 })
  assert.equal(forks.length, 2)
  for (const f of forks) {
    assert.ok(f instanceof Sandbox, String(f))
    t.track(f.sandboxId)
    assert.notEqual(f.sandboxId, sbx.sandboxId)
    assert.equal(await f.files.read('/home/user/fork.txt'), 'parent')
    assert.deepEqual(await readCounter(f, 9104), [n0 + 1, pid])
  }
  assert.notEqual(forks[0].sandboxId, forks[1].sandboxId)
  await forks[0].files.write('/home/user/fork.txt', 'child')
  assert.equal(await sbx.files.read('/home/user/fork.txt'), 'parent')
  assert.deepEqual(await readCounter(sbx, 9104), [n0 + 1, pid])
})
