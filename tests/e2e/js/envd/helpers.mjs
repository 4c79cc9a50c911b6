// Helpers for the envd end-to-end tests with the official E2B JS SDK (e2b@2.51.0).
// The tests run inside tests/e2e/envd-host.sh (E2B_DEBUG=true, envd on
// localhost:49983, a `user` with home /home/user).
import { spawn } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { createServer } from 'node:net'
import { Sandbox } from 'e2b'

process.env.E2B_DEBUG ??= 'true'

export const ENVD_URL = process.env.CUBICLE_ENVD_URL ?? 'http://localhost:49983'

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

export function uid() {
  return randomBytes(6).toString('hex')
}

/** Poll `fn` until it returns a truthy value or `timeoutMs` passes; returns the last value. */
export async function poll(fn, timeoutMs = 5000, intervalMs = 50) {
  const deadline = Date.now() + timeoutMs
  let v = await fn()
  while (!v && Date.now() < deadline) {
    await sleep(intervalMs)
    v = await fn()
  }
  return v
}

/** A fresh directory under /home/user owned by `user`; call the returned cleanup when done. */
export async function homeDir(sbx) {
  const path = `/home/user/js-${uid()}`
  if ((await sbx.files.makeDir(path)) !== true) throw new Error(`makeDir ${path} did not create it`)
  return path
}

export async function removeAsRoot(sbx, path) {
  try {
    await sbx.files.remove(path, { user: 'root' })
  } catch {
    // cleanup only
  }
}

async function freePort() {
  return await new Promise((resolve, reject) => {
    const srv = createServer()
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address()
      srv.close(() => resolve(port))
    })
    srv.on('error', reject)
  })
}

/**
 * Start a second envd with an access token set through POST /init (as the node does).
 * Returns { url, token, sandbox(token), stop() }.
 */
export async function startSecuredEnvd() {
  const bin = process.env.CUBICLE_ENVD_BIN
  if (!bin) throw new Error('CUBICLE_ENVD_BIN not set: run through tests/e2e/envd-host.sh')
  const port = await freePort()
  const url = `http://localhost:${port}`
  const token = 'cbjs' + randomBytes(24).toString('hex')
  const child = spawn(bin, ['--dev', '--port', String(port), '--default-user', 'user'], {
    env: { PATH: '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin', HOME: '/root' },
    stdio: ['ignore', 'ignore', 'pipe'],
  })
  let log = ''
  child.on('error', (e) => (log += `spawn failed: ${e}\n`))
  child.stderr.on('data', (d) => (log += d.toString()))
  // never let a leftover envd keep the test process alive
  child.unref()
  child.stderr.unref()
  const healthy = await poll(async () => {
    if (child.exitCode !== null || log.startsWith('spawn failed')) return true
    try {
      return (await fetch(`${url}/health`)).status === 204
    } catch {
      return false
    }
  }, 20000, 100)
  if (!healthy || child.exitCode !== null || log.startsWith('spawn failed')) {
    child.kill('SIGKILL')
    throw new Error(`second envd not healthy on ${url}; log:\n${log}`)
  }
  const init = await fetch(`${url}/init`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({
      envVars: { CUBICLE_INIT_VAR: 'from-init-js' },
      accessToken: token,
      defaultUser: 'user',
      defaultWorkdir: '/home/user',
    }),
  })
  if (init.status !== 204) {
    const text = await init.text()
    child.kill('SIGKILL')
    throw new Error(`POST /init → ${init.status} ${text}`)
  }
  return {
    url,
    token,
    // Built as Sandbox.create() builds one from a create response that carried
    // envdAccessToken; only the data-plane URL is overridden (E2B_SANDBOX_URL).
    sandbox: (tok = token) =>
      new Sandbox({ sandboxId: 'debug_sandbox_id', envdVersion: '99.99.99', envdAccessToken: tok, sandboxUrl: url, debug: true }),
    stop: async () => {
      child.kill('SIGTERM')
      await new Promise((r) => {
        if (child.exitCode !== null) return r()
        const t = setTimeout(() => {
          child.kill('SIGKILL')
          r()
        }, 5000)
        child.on('exit', () => {
          clearTimeout(t)
          r()
        })
      })
    },
  }
}
