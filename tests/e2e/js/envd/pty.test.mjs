// PTYs through the official JS SDK: create, input, output, resize, kill.
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { CommandExitError, Sandbox } from 'e2b'
import { poll } from './helpers.mjs'

const sbx = await Sandbox.create()
const enc = new TextEncoder()

test('pty: create, input, resize, kill', async () => {
  let out = ''
  const dec = new TextDecoder()
  const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => (out += dec.decode(d, { stream: true })) })
  try {
    assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid))
    await sbx.pty.sendInput(h.pid, enc.encode('echo $((6*7))-js\n'))
    assert.ok(await poll(() => out.includes('42-js'), 10000), out)
    await sbx.pty.sendInput(h.pid, enc.encode('echo "term=$TERM u=$(whoami)"; stty size\n'))
    assert.ok(await poll(() => out.includes('term=xterm-256color u=user'), 10000), out)
    assert.ok(await poll(() => out.includes('24 80'), 10000), out)
    await sbx.pty.resize(h.pid, { cols: 132, rows: 50 })
    await sbx.pty.sendInput(h.pid, enc.encode('stty size\n'))
    assert.ok(await poll(() => out.includes('50 132'), 10000), out)
  } finally {
    assert.equal(await sbx.pty.kill(h.pid), true)
  }
  await assert.rejects(h.wait(), CommandExitError)
  assert.ok(await poll(async () => !(await sbx.commands.list()).some((p) => p.pid === h.pid)))
})

test('pty: exit ends the session', async () => {
  const h = await sbx.pty.create({ cols: 40, rows: 10, onData: () => {} })
  await sbx.pty.sendInput(h.pid, enc.encode('exit 0\n'))
  const r = await h.wait()
  assert.equal(r.exitCode, 0)
})
