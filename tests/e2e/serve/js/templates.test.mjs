// Custom templates through the official JS SDK's Template.build(): from Cubicle's base
// (fromBaseImage), with a COPY from a build context and RUN steps, then a sandbox of it
// driven by the SDK; the same build again is all cache hits; a failing RUN names its step.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { mkdtempSync, writeFileSync, mkdirSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Template } from './e2b.mjs'
import { Tracker, uid, API_URL, API_KEY } from './helpers.mjs'

const sandboxes = new Tracker()
const made = []
after(async () => {
  await sandboxes.cleanup()
  for (const name of made) {
    await fetch(`${API_URL}/templates/${name}`, { method: 'DELETE', headers: { 'X-API-KEY': API_KEY } })
  }
})

test('Template.build from base: COPY + RUN, a sandbox of it, cached rebuild', async () => {
  const ctx = mkdtempSync(join(tmpdir(), 'cubicle-js-ctx-'))
  mkdirSync(join(ctx, 'site'))
  const name = `e2e-js-${uid()}`
  // Content unique to this run: the first build is never a cache hit.
  writeFileSync(join(ctx, 'site', 'index.html'), `<h1>${name}</h1>\n`)
  made.push(name)
  const template = Template({ fileContextPath: ctx })
    .fromBaseImage()
    .copy('site', '/home/user/site/')
    .runCmd(`echo js-built > /home/user/marker # ${name}`)
    .setEnvs({ FROM_JS: 'yes' })
  const logs = []
  const t0 = Date.now()
  const info = await Template.build(template, name, { onBuildLogs: (e) => logs.push(String(e.message)) })
  const first = (Date.now() - t0) / 1000
  assert.equal(info.templateId, name)
  const sbx = await sandboxes.create(name, { timeoutMs: 120_000 })
  const r = await sbx.commands.run('cat ~/marker ~/site/index.html; echo $FROM_JS; whoami')
  assert.equal(r.stdout, `js-built\n<h1>${name}</h1>\nyes\nuser\n`)
  const logs2 = []
  const t1 = Date.now()
  await Template.build(template, name, { onBuildLogs: (e) => logs2.push(String(e.message)) })
  const cached = (Date.now() - t1) / 1000
  console.log(`JS build from base: first ${first.toFixed(2)}s, cached ${cached.toFixed(2)}s`)
  assert.ok(logs2.some((l) => l.includes('CACHED')), logs2.join('\n'))
  rmSync(ctx, { recursive: true, force: true })
})

test('a failing RUN fails Template.build with the step and the exit code', async () => {
  const name = `e2e-js-fail-${uid()}`
  made.push(name)
  const template = Template().fromBaseImage().runCmd('exit 4')
  await assert.rejects(Template.build(template, name), (e) => {
    assert.match(String(e.message), /exited with code 4/)
    return true
  })
})
