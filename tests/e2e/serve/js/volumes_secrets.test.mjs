// Volumes and secrets through `cubicle serve` with the official JS SDK (issue 17): the
// volume control routes and content API (found through E2B_VOLUME_API_URL), a mount at
// create with owners as the sandbox sees them, a volume in use that cannot be deleted;
// secrets created, read back without their value, updated, listed and destroyed.
import assert from 'node:assert/strict'
import { after, test } from 'node:test'
import { Secret, SecretError, SecretNotFoundError, Volume, VolumeError, VolumeNotFoundError } from './e2b.mjs'
import { KEY_B, TEMPLATE, Tracker, uid } from './helpers.mjs'

const t = new Tracker()
const volumes = []
const secrets = []
after(async () => {
  await t.cleanup()
  for (const id of volumes.splice(0)) await Volume.destroy(id)
  for (const id of secrets.splice(0)) await Secret.destroy(id)
})

test('volumes: control routes, content API, mount with owners, in use', { skip: !process.env.E2B_VOLUME_API_URL && 'E2B_VOLUME_API_URL not set' }, async () => {
  const name = `e2e-js-${uid()}`
  const vol = await Volume.create(name)
  volumes.push(vol.volumeId)
  assert.equal(vol.name, name)
  assert.ok(vol.token)
  assert.ok((await Volume.list()).some((v) => v.volumeId === vol.volumeId && v.name === name))
  assert.equal((await Volume.getInfo(vol.volumeId)).token, vol.token)
  await assert.rejects(Volume.create(name), VolumeError)
  if (KEY_B) await assert.rejects(Volume.getInfo(vol.volumeId, { apiKey: KEY_B }), VolumeNotFoundError)

  await vol.makeDir('/d', { force: true })
  const w = await vol.writeFile('/d/hello.txt', 'hello from js')
  assert.equal(w.size, 13)
  assert.equal(await vol.readFile('/d/hello.txt'), 'hello from js')
  assert.deepEqual((await vol.list('/')).map((e) => e.path), ['/d'])
  assert.equal(await vol.exists('/nope'), false)

  const sbx = await t.create(TEMPLATE, { volumeMounts: { '/mnt/js': vol }, timeoutMs: 300_000 })
  assert.equal(await sbx.files.read('/mnt/js/d/hello.txt'), 'hello from js')
  await sbx.commands.run('echo by-user > /mnt/js/u.txt')
  await sbx.commands.run('echo by-root > /mnt/js/r.txt', { user: 'root' })
  const owners = (await sbx.commands.run("stat -c '%U %u' /mnt/js/u.txt /mnt/js/r.txt")).stdout.trim().split('\n')
  assert.deepEqual(owners, ['user 1000', 'root 0'])
  assert.equal((await vol.getInfo('/u.txt')).uid, 1000)
  assert.equal(await vol.readFile('/r.txt'), 'by-root\n')
  // Mounted: cannot be deleted, and stays intact.
  await assert.rejects(Volume.destroy(vol.volumeId), (e) => e instanceof VolumeError && /in use/.test(e.message))
  assert.equal(await vol.readFile('/u.txt'), 'by-user\n')
  await sbx.kill()
  await vol.remove('/d')
  assert.equal(await vol.exists('/d/hello.txt'), false)
  volumes.splice(volumes.indexOf(vol.volumeId), 1)
  assert.equal(await Volume.destroy(vol.volumeId), true)
  assert.equal(await Volume.destroy(vol.volumeId), false)
})

test('secrets: write-only values, versions, paging, per team', async () => {
  const name = `e2e-js-${uid()}`
  const value = `js-secret-${uid()}${uid()}`
  const info = await Secret.create(name, value, { metadata: { owner: 'js' } })
  secrets.push(info.secretId)
  assert.match(info.secretId, /^sec_/)
  assert.equal(info.name, name)
  assert.equal(info.version, 1)
  assert.deepEqual(info.metadata, { owner: 'js' })
  assert.ok(!JSON.stringify(info).includes(value))
  const got = await Secret.getInfo(name)
  assert.equal(got.secretId, info.secretId)
  assert.ok(!JSON.stringify(got).includes(value))
  await assert.rejects(Secret.create(name, 'again'), SecretError)
  const up = await Secret.update(info.secretId, value + '-2')
  assert.equal(up.version, 2)
  assert.deepEqual(up.metadata, { owner: 'js' })
  await assert.rejects(Secret.getInfo(`nope-${uid()}`), SecretNotFoundError)
  const seen = []
  const pages = Secret.list({ limit: 1 })
  while (pages.hasNext) {
    const page = await pages.nextItems()
    assert.ok(page.length <= 1)
    seen.push(...page.map((s) => s.secretId))
    assert.ok(seen.length < 1000)
  }
  assert.ok(seen.includes(info.secretId))
  if (KEY_B) {
    assert.equal(await Secret.exists(info.secretId, { apiKey: KEY_B }), false)
    assert.equal(await Secret.destroy(info.secretId, { apiKey: KEY_B }), false)
  }
  secrets.splice(secrets.indexOf(info.secretId), 1)
  assert.equal(await Secret.destroy(name), true)
  assert.equal(await Secret.exists(info.secretId), false)
})
