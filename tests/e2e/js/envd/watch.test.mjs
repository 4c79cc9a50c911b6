// watchDir through the official JS SDK (WatchDir stream): events, recursive, includeEntry.
import assert from 'node:assert/strict'
import { after, before, test } from 'node:test'
import { FileNotFoundError, FilesystemEventType as ET, FileType, Sandbox } from 'e2b'
import { homeDir, poll, removeAsRoot, sleep } from './helpers.mjs'

const sbx = await Sandbox.create()
let dir
before(async () => {
  dir = await homeDir(sbx)
})
after(async () => {
  await removeAsRoot(sbx, dir)
})

const has = (events, name, type) => events.some((e) => e.name === name && e.type === type)

test('watchDir: create, write, rename, remove', async () => {
  const events = []
  const h = await sbx.files.watchDir(dir, (e) => events.push(e))
  try {
    await sbx.files.write(`${dir}/w.txt`, '1')
    await sbx.files.rename(`${dir}/w.txt`, `${dir}/w2.txt`)
    await sbx.files.remove(`${dir}/w2.txt`)
    const ok = await poll(
      () => has(events, 'w.txt', ET.CREATE) && has(events, 'w.txt', ET.WRITE) && has(events, 'w.txt', ET.RENAME) && has(events, 'w2.txt', ET.REMOVE),
      8000,
    )
    assert.ok(ok, JSON.stringify(events))
    assert.ok(events.every((e) => e.entry === undefined), 'no entry without includeEntry')
  } finally {
    await h.stop()
  }
})

test('watchDir: recursive + includeEntry', async () => {
  await sbx.files.makeDir(`${dir}/r/sub`)
  const events = []
  const h = await sbx.files.watchDir(`${dir}/r`, (e) => events.push(e), { recursive: true, includeEntry: true })
  try {
    await sbx.files.write(`${dir}/r/sub/deep.txt`, 'abc')
    assert.ok(await poll(() => has(events, 'sub/deep.txt', ET.CREATE), 8000), JSON.stringify(events))
    const ev = events.find((e) => e.name === 'sub/deep.txt' && e.type === ET.CREATE)
    assert.ok(ev.entry, 'entry requested')
    assert.equal(ev.entry.path, `${dir}/r/sub/deep.txt`)
    assert.equal(ev.entry.type, FileType.FILE)
  } finally {
    await h.stop()
  }
})

test('watchDir: non-recursive ignores subdirectories', async () => {
  await sbx.files.makeDir(`${dir}/nr/sub`)
  const events = []
  const h = await sbx.files.watchDir(`${dir}/nr`, (e) => events.push(e))
  try {
    await sbx.files.write(`${dir}/nr/sub/inner.txt`, 'x')
    await sbx.files.write(`${dir}/nr/top.txt`, 'x')
    assert.ok(await poll(() => has(events, 'top.txt', ET.CREATE), 8000))
    await sleep(300)
    assert.ok(!events.some((e) => e.name.includes('inner')), JSON.stringify(events))
  } finally {
    await h.stop()
  }
})

test('watchDir: missing directory', async () => {
  await assert.rejects(sbx.files.watchDir(`${dir}/missing`, () => {}), FileNotFoundError)
})

test('watchDir: timeout ends the watch with an error', async () => {
  let exit = null
  const h = await sbx.files.watchDir(dir, () => {}, { timeoutMs: 1000, onExit: (err) => (exit = { err }) })
  assert.ok(await poll(() => exit !== null, 5000), 'watch did not end')
  assert.ok(exit.err, 'deadline reported as an error')
  await h.stop()
})
