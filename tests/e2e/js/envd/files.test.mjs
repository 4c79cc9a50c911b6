// Files through the official JS SDK: write (string, ArrayBuffer, Blob,
// ReadableStream, many), read (text, bytes, blob, stream), list with depth,
// exists, getInfo, makeDir, rename, remove, metadata, users, `~` and relative paths.
import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import { after, before, test } from 'node:test'
import { FileNotFoundError, FileType, Sandbox } from 'e2b'
import { homeDir, removeAsRoot, uid } from './helpers.mjs'

const sbx = await Sandbox.create()
let dir
before(async () => {
  dir = await homeDir(sbx)
})
after(async () => {
  await removeAsRoot(sbx, dir)
})

const sha = (buf) => createHash('sha256').update(buf).digest('hex')
const statOf = async (path, fmt) => (await sbx.commands.run(`stat -c '${fmt}' '${path}'`, { user: 'root' })).stdout.trim()

test('write string, read text', async () => {
  const info = await sbx.files.write(`${dir}/a.txt`, 'héllo js\n')
  assert.equal(info.path, `${dir}/a.txt`)
  assert.equal(info.name, 'a.txt')
  assert.equal(info.type, FileType.FILE)
  assert.equal(await sbx.files.read(`${dir}/a.txt`), 'héllo js\n')
  assert.equal((await sbx.commands.run(`cat ${dir}/a.txt`)).stdout, 'héllo js\n')
})

test('write ArrayBuffer / Blob, read bytes / blob', async () => {
  const data = randomBytes(100_000)
  await sbx.files.write(`${dir}/b.bin`, data.buffer.slice(data.byteOffset, data.byteOffset + data.length))
  const bytes = await sbx.files.read(`${dir}/b.bin`, { format: 'bytes' })
  assert.ok(bytes instanceof Uint8Array)
  assert.equal(sha(bytes), sha(data))
  await sbx.files.write(`${dir}/blob.bin`, new Blob([data]))
  const blob = await sbx.files.read(`${dir}/blob.bin`, { format: 'blob' })
  assert.equal(sha(Buffer.from(await blob.arrayBuffer())), sha(data))
})

test('write ReadableStream, read stream', async () => {
  const data = randomBytes(4 * 1024 * 1024 + 3)
  let off = 0
  const rs = new ReadableStream({
    pull(ctrl) {
      if (off >= data.length) return ctrl.close()
      ctrl.enqueue(new Uint8Array(data.subarray(off, off + 65536)))
      off += 65536
    },
  })
  await sbx.files.write(`${dir}/s.bin`, rs)
  const stream = await sbx.files.read(`${dir}/s.bin`, { format: 'stream' })
  const chunks = []
  for await (const c of stream) chunks.push(c)
  assert.equal(sha(Buffer.concat(chunks)), sha(data))
})

test('write many files', async () => {
  const files = Array.from({ length: 10 }, (_, i) => ({ path: `${dir}/many/${i % 3}/f${i}.txt`, data: `c${i}` }))
  const infos = await sbx.files.write(files)
  assert.deepEqual(infos.map((i) => i.path).sort(), files.map((f) => f.path).sort())
  for (const f of files) assert.equal(await sbx.files.read(f.path), f.data)
})

test('list with depth', async () => {
  await sbx.commands.run(`mkdir -p ${dir}/t/d1/d2 && echo 1 > ${dir}/t/f && echo 2 > ${dir}/t/d1/g && echo 3 > ${dir}/t/d1/d2/h`)
  const rel = (es) => es.map((e) => e.path.slice(`${dir}/t/`.length)).sort()
  assert.deepEqual(rel(await sbx.files.list(`${dir}/t`)), ['d1', 'f'])
  assert.deepEqual(rel(await sbx.files.list(`${dir}/t`, { depth: 2 })), ['d1', 'd1/d2', 'd1/g', 'f'])
  assert.deepEqual(rel(await sbx.files.list(`${dir}/t`, { depth: 3 })), ['d1', 'd1/d2', 'd1/d2/h', 'd1/g', 'f'])
  const types = Object.fromEntries((await sbx.files.list(`${dir}/t`)).map((e) => [e.name, e.type]))
  assert.deepEqual(types, { d1: FileType.DIR, f: FileType.FILE })
  await assert.rejects(sbx.files.list(`${dir}/nope`), FileNotFoundError)
})

test('exists and getInfo', async () => {
  await sbx.files.write(`${dir}/info.txt`, '12345')
  await sbx.commands.run(`chmod 604 ${dir}/info.txt`)
  assert.equal(await sbx.files.exists(`${dir}/info.txt`), true)
  assert.equal(await sbx.files.exists(`${dir}/missing`), false)
  const info = await sbx.files.getInfo(`${dir}/info.txt`)
  assert.equal(info.size, 5)
  assert.equal(info.type, FileType.FILE)
  assert.equal(info.permissions, await statOf(`${dir}/info.txt`, '%A'))
  assert.equal(info.permissions, '-rw----r--')
  assert.equal(info.mode & 0o777, 0o604)
  assert.equal(info.owner, 'user')
  assert.equal(info.group, 'user')
  assert.ok(info.modifiedTime instanceof Date)
  assert.equal(Math.floor(info.modifiedTime.getTime() / 1000), Number(await statOf(`${dir}/info.txt`, '%Y')))
  await assert.rejects(sbx.files.getInfo(`${dir}/missing`), FileNotFoundError)
})

test('makeDir true then false; rename; remove', async () => {
  assert.equal(await sbx.files.makeDir(`${dir}/m/n`), true)
  assert.equal(await sbx.files.makeDir(`${dir}/m/n`), false)
  assert.equal(await statOf(`${dir}/m`, '%U %F'), 'user directory')
  await sbx.files.write(`${dir}/m/n/x`, 'x')
  const moved = await sbx.files.rename(`${dir}/m/n/x`, `${dir}/m/y`)
  assert.equal(moved.path, `${dir}/m/y`)
  assert.equal(await sbx.files.exists(`${dir}/m/n/x`), false)
  await sbx.files.remove(`${dir}/m`)
  assert.equal(await sbx.files.exists(`${dir}/m`), false)
  await sbx.files.remove(`${dir}/never`)
})

test('metadata', async () => {
  const w = await sbx.files.write(`${dir}/meta`, 'm', { metadata: { Owner: 'js', k: 'v w' } })
  assert.deepEqual(w.metadata, { owner: 'js', k: 'v w' })
  assert.deepEqual((await sbx.files.getInfo(`${dir}/meta`)).metadata, { owner: 'js', k: 'v w' })
})

test('users: ownership', async () => {
  const p = `/tmp/cb-js-root-${uid()}`
  await sbx.files.write(p, 'r', { user: 'root' })
  try {
    assert.equal((await sbx.files.getInfo(p)).owner, 'root')
    assert.equal(await statOf(p, '%U'), 'root')
  } finally {
    await removeAsRoot(sbx, p)
  }
})

test('~ and relative paths', async () => {
  const name = `cb-js-tilde-${uid()}`
  try {
    const info = await sbx.files.write(`~/${name}`, 't')
    assert.equal(info.path, `/home/user/${name}`)
    assert.equal(await sbx.files.read(name), 't')
    assert.equal((await sbx.commands.run(`cat /home/user/${name}`)).stdout, 't')
    // relative paths follow the requested user: root's land under /root
    const r = await sbx.files.write(`rel-${name}`, 'r', { user: 'root' })
    assert.equal(r.path, `/root/rel-${name}`)
    assert.equal(await sbx.files.read(`rel-${name}`, { user: 'root' }), 'r')
    assert.equal(await sbx.files.exists(`rel-${name}`), false)
    assert.equal((await sbx.files.getInfo(`rel-${name}`, { user: 'root' })).owner, 'root')
    assert.equal((await sbx.commands.run('pwd', { user: 'root' })).stdout, '/root\n')
  } finally {
    await removeAsRoot(sbx, `/home/user/${name}`)
    await removeAsRoot(sbx, `/root/rel-${name}`)
  }
})
