// Error paths and team isolation through `cubicle serve` with the official JS SDK.
import assert from 'node:assert/strict'
import { after, test } from 'node:test'
import { AuthenticationError, NotFoundError, Sandbox, SandboxError, SandboxNotFoundError } from './e2b.mjs'
import { FAST_TEMPLATE, KEY_B, Tracker, listAll, uid } from './helpers.mjs'

const t = new Tracker()
after(() => t.cleanup())
const missing = 'i' + '3'.repeat(20)

test('wrong key → AuthenticationError', async () => {
  await assert.rejects(Sandbox.create(FAST_TEMPLATE, { apiKey: 'e2b_wrong_' + uid() }), AuthenticationError)
  await assert.rejects(Sandbox.list({ apiKey: 'nope' }).nextItems(), AuthenticationError)
  await assert.rejects(Sandbox.kill(missing, { apiKey: 'nope' }), AuthenticationError)
})

test('unknown sandbox → SandboxNotFoundError / NotFoundError / false', async () => {
  await assert.rejects(Sandbox.getInfo(missing), SandboxNotFoundError)
  await assert.rejects(Sandbox.connect(missing), (e) => e instanceof SandboxNotFoundError || e instanceof NotFoundError)
  await assert.rejects(Sandbox.setTimeout(missing, 10_000), (e) => e instanceof SandboxNotFoundError || e instanceof NotFoundError)
  assert.equal(await Sandbox.kill(missing), false)
})

test('unknown template → an error naming it', async () => {
  const name = `no-such-template-${uid()}`
  await assert.rejects(Sandbox.create(name), (e) => e instanceof SandboxError && String(e.message).includes(name))
})

test('two teams cannot see or touch each other', { skip: !KEY_B && 'CUBICLE_E2E_KEY_B not set' }, async () => {
  const tag = uid()
  const a = await t.create(FAST_TEMPLATE, { metadata: { tag } })
  const b = await t.create(FAST_TEMPLATE, { metadata: { tag }, apiKey: KEY_B })
  assert.deepEqual((await listAll({ query: { metadata: { tag } } })).map((s) => s.sandboxId), [a.sandboxId])
  assert.deepEqual((await listAll({ query: { metadata: { tag } }, apiKey: KEY_B })).map((s) => s.sandboxId), [b.sandboxId])
  await assert.rejects(Sandbox.getInfo(a.sandboxId, { apiKey: KEY_B }), SandboxNotFoundError)
  await assert.rejects(Sandbox.connect(a.sandboxId, { apiKey: KEY_B }), SandboxNotFoundError)
  await assert.rejects(Sandbox.setTimeout(a.sandboxId, 5000, { apiKey: KEY_B }), (e) => e instanceof NotFoundError || e instanceof SandboxNotFoundError)
  assert.equal(await Sandbox.kill(a.sandboxId, { apiKey: KEY_B }), false)
  assert.equal(await Sandbox.kill(b.sandboxId), false)
  assert.equal(await a.isRunning(), true)
  assert.equal(await Sandbox.kill(b.sandboxId, { apiKey: KEY_B }), true)
})
