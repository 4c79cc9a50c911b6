// Access token (set through POST /init on a second envd) and signed
// downloadUrl/uploadUrl with the official JS SDK; the URLs are then used the way
// a browser would (plain fetch, no headers).
import assert from 'node:assert/strict'
import { after, before, test } from 'node:test'
import { AuthenticationError, Sandbox } from 'e2b'
import { startSecuredEnvd, uid } from './helpers.mjs'

let envd
let sbx
before(async () => {
  envd = await startSecuredEnvd()
  sbx = envd.sandbox()
})
after(async () => {
  await envd?.stop()
})

async function assert401(res) {
  assert.equal(res.status, 401, `${res.status} ${await res.clone().text()}`)
  const body = await res.json()
  assert.equal(body.code, 401)
  assert.ok(body.message)
}

test('token: SDK with the token works, /init envs applied', async () => {
  const r = await sbx.commands.run('echo "$CUBICLE_INIT_VAR|$(whoami)|$(pwd)"')
  assert.equal(r.stdout, 'from-init-js|user|/home/user\n')
})

test('token: missing or wrong token is rejected', async () => {
  await assert.rejects(envd.sandbox(null).commands.run('true'), AuthenticationError)
  await assert.rejects(envd.sandbox('wrong-token').files.list('/'), AuthenticationError)
  assert.equal((await fetch(`${envd.url}/health`)).status, 204)
  await assert401(await fetch(`${envd.url}/files?path=/etc/hostname`))
})

test('downloadUrl without and with expiration', async () => {
  const p = `/home/user/js-dl-${uid()}.txt`
  await sbx.files.write(p, 'download me')
  try {
    const url = await sbx.downloadUrl(p)
    const q = new URL(url).searchParams
    assert.equal(q.get('path'), p)
    assert.match(q.get('signature'), /^v1_/)
    assert.equal(q.get('signature_expiration'), null)
    let res = await fetch(url)
    assert.equal(res.status, 200)
    assert.equal(await res.text(), 'download me')

    const exp = await sbx.downloadUrl(p, { useSignatureExpiration: 60 })
    assert.ok(new URL(exp).searchParams.get('signature_expiration'))
    res = await fetch(exp)
    assert.equal(await res.text(), 'download me')

    await assert401(await fetch(await sbx.downloadUrl(p, { useSignatureExpiration: -5 })))
    const tampered = new URL(url)
    tampered.searchParams.set('signature', q.get('signature').slice(0, -3) + 'xyz')
    await assert401(await fetch(tampered))
    const otherPath = new URL(url)
    otherPath.searchParams.set('path', '/etc/passwd')
    await assert401(await fetch(otherPath))
  } finally {
    await sbx.files.remove(p)
  }
})

test('uploadUrl without and with expiration', async () => {
  const p = `/home/user/js-ul-${uid()}/up.txt`
  const form = new FormData()
  form.append('file', new Blob(['uploaded from a browser']), 'local.txt')
  let res = await fetch(await sbx.uploadUrl(p), { method: 'POST', body: form })
  assert.equal(res.status, 200, await res.clone().text())
  assert.equal((await res.json())[0].path, p)
  assert.equal(await sbx.files.read(p), 'uploaded from a browser')
  assert.equal((await sbx.files.getInfo(p)).owner, 'user')

  const form2 = new FormData()
  form2.append('file', new Blob(['second']), 'x.txt')
  res = await fetch(await sbx.uploadUrl(p, { useSignatureExpiration: 60 }), { method: 'POST', body: form2 })
  assert.equal(res.status, 200)
  assert.equal(await sbx.files.read(p), 'second')
  await sbx.files.remove(p.slice(0, p.lastIndexOf('/')))
})

test('rejected uploads answer 401 reliably (the browser must see the 401)', async () => {
  // envd must answer a refused upload without making the client's body write fail
  // (e.g. drain a small body before closing), or fetch() reports a network error.
  const p = `/home/user/js-ul-rej-${uid()}.txt`
  const outcomes = { 401: 0 }
  for (let i = 0; i < 30; i++) {
    const form = new FormData()
    form.append('file', new Blob(['x'.repeat(2000)]), 'x.txt')
    try {
      const res = await fetch(await sbx.uploadUrl(p, { useSignatureExpiration: -5 }), { method: 'POST', body: form })
      outcomes[res.status] = (outcomes[res.status] ?? 0) + 1
      await res.arrayBuffer()
    } catch (e) {
      const key = `${e}: ${e.cause}`
      outcomes[key] = (outcomes[key] ?? 0) + 1
    }
  }
  assert.deepEqual(outcomes, { 401: 30 })
  assert.equal(await sbx.files.exists(p), false)
})

test('unsigned URLs on the token-less debug envd', async () => {
  const plain = await Sandbox.create()
  const p = `/home/user/js-plain-${uid()}.txt`
  await plain.files.write(p, 'plain')
  try {
    const url = await plain.downloadUrl(p)
    assert.equal(new URL(url).searchParams.get('signature'), null)
    assert.equal(await (await fetch(url)).text(), 'plain')
  } finally {
    await plain.files.remove(p)
  }
})
