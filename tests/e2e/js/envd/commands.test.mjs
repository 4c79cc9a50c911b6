// Commands through the official JS SDK: output, exit codes, envs, cwd, users,
// timeouts, background handles, stdin, list, connect, callbacks.
import assert from 'node:assert/strict'
import { readdirSync, readFileSync } from 'node:fs'
import { test } from 'node:test'
import { CommandExitError, NotFoundError, Sandbox, SandboxError, TimeoutError } from 'e2b'
import { poll, sleep, uid } from './helpers.mjs'

const sbx = await Sandbox.create()

function pidsWithCmdline(fragment) {
  const out = []
  for (const name of readdirSync('/proc')) {
    if (!/^\d+$/.test(name) || Number(name) === process.pid) continue
    try {
      const cmd = readFileSync(`/proc/${name}/cmdline`).toString().replaceAll('\0', ' ')
      const stat = readFileSync(`/proc/${name}/stat`, 'utf8')
      if (cmd.includes(fragment) && stat.slice(stat.lastIndexOf(')') + 2)[0] !== 'Z') out.push(Number(name))
    } catch {
      // raced with exit
    }
  }
  return out
}

const listedPids = async () => (await sbx.commands.list()).map((p) => p.pid)

test('debug-mode sandbox id', () => {
  assert.equal(sbx.sandboxId, 'debug_sandbox_id')
})

test('stdout, stderr, exit code 0', async () => {
  const r = await sbx.commands.run('echo hello; echo oops >&2')
  assert.equal(r.stdout, 'hello\n')
  assert.equal(r.stderr, 'oops\n')
  assert.equal(r.exitCode, 0)
  assert.equal(r.error, undefined)
})

test('non-zero exit throws CommandExitError', async () => {
  await assert.rejects(sbx.commands.run('echo out; echo err >&2; exit 7'), (e) => {
    assert.ok(e instanceof CommandExitError, String(e))
    assert.equal(e.exitCode, 7)
    assert.equal(e.stdout, 'out\n')
    assert.equal(e.stderr, 'err\n')
    assert.match(e.error ?? '', /7/)
    return true
  })
})

test('envs and cwd', async () => {
  const r = await sbx.commands.run('echo "$A|$B|$(pwd)"', { envs: { A: '1', B: 'x y' }, cwd: '/tmp' })
  assert.equal(r.stdout, '1|x y|/tmp\n')
  assert.equal((await sbx.commands.run('pwd')).stdout, '/home/user\n')
  await assert.rejects(sbx.commands.run('pwd', { cwd: `/nonexistent-${uid()}` }), SandboxError)
})

test('default user vs root', async () => {
  assert.equal((await sbx.commands.run('whoami')).stdout, 'user\n')
  assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
  assert.equal((await sbx.commands.run('echo $HOME', { user: 'root' })).stdout, '/root\n')
})

test('timeout kills the process', async () => {
  const marker = `cbjstimeout${uid()}`
  const t0 = Date.now()
  await assert.rejects(sbx.commands.run(`sleep 10; echo ${marker}`, { timeoutMs: 1000 }), (e) => {
    assert.ok(e instanceof TimeoutError, `expected TimeoutError, got ${e?.constructor?.name}: ${e}`)
    return true
  })
  assert.ok(Date.now() - t0 < 5000)
  const gone = await poll(async () => {
    const listed = (await sbx.commands.list()).filter((p) => p.args.join(' ').includes(marker))
    return listed.length === 0 && pidsWithCmdline(marker).length === 0
  })
  assert.ok(gone, 'process still running after its timeout')
})

test('background + wait', async () => {
  const h = await sbx.commands.run('sleep 0.5; echo done', { background: true })
  assert.ok(h.pid > 0)
  assert.ok((await listedPids()).includes(h.pid))
  const r = await h.wait()
  assert.equal(r.stdout, 'done\n')
  assert.equal(r.exitCode, 0)
})

test('background + kill', async () => {
  const h = await sbx.commands.run('sleep 30', { background: true })
  assert.equal(await h.kill(), true)
  await assert.rejects(h.wait(), CommandExitError)
  assert.ok(await poll(async () => !(await listedPids()).includes(h.pid)))
  assert.equal(await sbx.commands.kill(h.pid), false)
})

test('sendStdin and closeStdin', async () => {
  const h = await sbx.commands.run('cat; echo END', { background: true, stdin: true })
  await sbx.commands.sendStdin(h.pid, 'abc ')
  await h.sendStdin(new TextEncoder().encode('def\n'))
  await sleep(200)
  assert.equal(h.exitCode, undefined, 'cat waits for EOF')
  await sbx.commands.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.stdout, 'abc def\nEND\n')
})

test('stdin is closed by default', async () => {
  const r = await sbx.commands.run('cat; echo after', { timeoutMs: 10000 })
  assert.equal(r.stdout, 'after\n')
})

test('list reports the command config', async () => {
  const h = await sbx.commands.run('sleep 30', { background: true, envs: { CBJS: '1' }, cwd: '/tmp' })
  try {
    const info = (await sbx.commands.list()).find((p) => p.pid === h.pid)
    assert.ok(info)
    assert.equal(info.cmd, '/bin/bash')
    assert.deepEqual(info.args, ['-l', '-c', 'sleep 30'])
    assert.equal(info.envs.CBJS, '1')
    assert.equal(info.cwd, '/tmp')
  } finally {
    await h.kill()
  }
})

test('connect re-attaches to a running process', async () => {
  const h = await sbx.commands.run('for i in 1 2 3 4 5; do echo t$i; sleep 0.3; done', { background: true })
  await sleep(400)
  await h.disconnect()
  const seen = []
  const h2 = await sbx.commands.connect(h.pid, { onStdout: (d) => seen.push(d) })
  const r = await h2.wait()
  assert.equal(r.exitCode, 0)
  assert.ok(r.stdout.endsWith('t5\n'), r.stdout)
  assert.equal(seen.join(''), r.stdout)
  await assert.rejects(sbx.commands.connect(999999), NotFoundError)
})

test('onStdout/onStderr callbacks in order', async () => {
  const events = []
  const r = await sbx.commands.run('echo a; sleep 0.2; echo b >&2; sleep 0.2; echo c; sleep 0.2; echo d >&2', {
    onStdout: (d) => events.push(['out', d]),
    onStderr: (d) => events.push(['err', d]),
  })
  assert.deepEqual(events, [
    ['out', 'a\n'],
    ['err', 'b\n'],
    ['out', 'c\n'],
    ['err', 'd\n'],
  ])
  assert.equal(r.stdout, 'a\nc\n')
})

test('large output', async () => {
  const r = await sbx.commands.run("head -c 2000000 /dev/zero | tr '\\0' y")
  assert.equal(r.stdout.length, 2_000_000)
})
