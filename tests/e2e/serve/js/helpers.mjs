// Helpers for the `cubicle serve` JS suite (run through tests/e2e/serve/run.sh, which
// exports E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY from the server's output and the
// test-only CUBICLE_E2E_* knobs).
import { appendFileSync } from 'node:fs'
import { randomBytes } from 'node:crypto'
import { Sandbox } from './e2b.mjs'

for (const v of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  if (!process.env[v]) throw new Error(`${v} is not set: run through tests/e2e/serve/run.sh`)
}
export const SANDBOX_URL = process.env.E2B_SANDBOX_URL
export const API_URL = process.env.E2B_API_URL
export const API_KEY = process.env.E2B_API_KEY
export const KEY_B = process.env.CUBICLE_E2E_KEY_B || ''
export const DOMAIN = process.env.CUBICLE_E2E_DOMAIN || ''
export const TEMPLATE = process.env.CUBICLE_E2E_TEMPLATE || 'base'
export const FAST_TEMPLATE = process.env.CUBICLE_E2E_FAST_TEMPLATE || 'tiny'

// Against a cluster (tests/e2e/cluster/serve_suite.sh sets CUBICLE_E2E_CLUSTER=1): tests
// that need a single host, or a feature an API replica does not offer yet, are skipped
// with why (as the Python suite's markers; docs/cluster.md, "Tested").
export const CLUSTER = process.env.CUBICLE_E2E_CLUSTER === '1'
export const singleHost = (why) => ({ skip: CLUSTER && `cluster: single host only: ${why}` })
export const clusterPending = (why) => ({ skip: CLUSTER && `cluster: not through a replica yet: ${why}` })

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
export const uid = () => randomBytes(6).toString('hex')

export async function poll(fn, timeoutMs = 10000, intervalMs = 200) {
  const deadline = Date.now() + timeoutMs
  let v = await fn()
  while (!v && Date.now() < deadline) {
    await sleep(intervalMs)
    v = await fn()
  }
  return v
}

/** Creates sandboxes and kills every one of them in cleanup(). */
export class Tracker {
  constructor() {
    this.made = []
  }
  track(id, apiKey = API_KEY) {
    if (process.env.CUBICLE_E2E_IDS_FILE) appendFileSync(process.env.CUBICLE_E2E_IDS_FILE, id + '\n')
    this.made.push([id, apiKey])
  }
  async create(template, opts = {}) {
    const sbx = await Sandbox.create(template ?? TEMPLATE, opts)
    this.track(sbx.sandboxId, opts.apiKey ?? API_KEY)
    return sbx
  }
  async cleanup() {
    const errors = []
    for (const [id, apiKey] of this.made.splice(0)) {
      try {
        await Sandbox.kill(id, { apiKey })
      } catch (e) {
        errors.push(`${id}: ${e}`)
      }
    }
    if (errors.length) throw new Error('cleanup failed: ' + errors.join('; '))
  }
}

export async function listAll(opts) {
  const pager = Sandbox.list(opts)
  const out = []
  while (pager.hasNext) out.push(...(await pager.nextItems()))
  return out
}
