// envd's Connect API (JSON codec) from the browser, through `cubicle serve`'s data plane,
// the way the E2B SDKs reach it: POST /<package>.<Service>/<Method> on this origin with
// E2b-Sandbox-Id, E2b-Sandbox-Port: 49983 and X-Access-Token. Server streams arrive as
// envelopes (flags:u8, length:u32 big-endian, JSON); flag 0x02 ends the stream and may
// carry {"error":{code,message}}.

export const ENVD_PORT = 49983;

function headers(sandbox, contentType) {
  const h = {
    'Content-Type': contentType,
    'Connect-Protocol-Version': '1',
    'E2b-Sandbox-Id': sandbox.id,
    'E2b-Sandbox-Port': String(ENVD_PORT),
  };
  if (sandbox.token) h['X-Access-Token'] = sandbox.token;
  // envd's acting user, as the SDKs choose it: Basic auth with an empty password.
  if (sandbox.user) h['Authorization'] = 'Basic ' + btoa(sandbox.user + ':');
  return h;
}

export class ConnectError extends Error {
  constructor(code, message) {
    super(`${code}: ${message}`);
    this.code = code;
  }
}

async function failure(resp) {
  const text = await resp.text();
  try {
    const v = JSON.parse(text);
    return new ConnectError(v.code || resp.status, v.message || text);
  } catch {
    return new ConnectError(resp.status, text || resp.statusText);
  }
}

/** One unary call; resolves to the decoded answer. */
export async function unary(sandbox, method, message) {
  const resp = await fetch('/' + method, {
    method: 'POST',
    headers: headers(sandbox, 'application/json'),
    body: JSON.stringify(message),
  });
  if (!resp.ok) throw await failure(resp);
  return resp.json();
}

function envelope(message) {
  const payload = new TextEncoder().encode(JSON.stringify(message));
  const out = new Uint8Array(5 + payload.length);
  new DataView(out.buffer).setUint32(1, payload.length);
  out.set(payload, 5);
  return out;
}

/**
 * A server-streaming call: calls onMessage(decoded) for each message and resolves when
 * the stream ends (rejects with the stream's error). `signal` aborts it.
 */
export async function serverStream(sandbox, method, message, onMessage, signal) {
  const resp = await fetch('/' + method, {
    method: 'POST',
    headers: { ...headers(sandbox, 'application/connect+json'), 'Connect-Accept-Encoding': 'identity' },
    body: envelope(message),
    signal,
  });
  if (!resp.ok) throw await failure(resp);
  const reader = resp.body.getReader();
  let buf = new Uint8Array(0);
  const decoder = new TextDecoder();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new ConnectError('unavailable', 'the stream ended without its end message');
    const joined = new Uint8Array(buf.length + value.length);
    joined.set(buf);
    joined.set(value, buf.length);
    buf = joined;
    while (buf.length >= 5) {
      const flags = buf[0];
      const len = new DataView(buf.buffer, buf.byteOffset, 5).getUint32(1);
      if (buf.length < 5 + len) break;
      const payload = JSON.parse(decoder.decode(buf.subarray(5, 5 + len)) || '{}');
      buf = buf.slice(5 + len);
      if (flags & 0x02) {
        if (payload.error) throw new ConnectError(payload.error.code, payload.error.message || '');
        return;
      }
      onMessage(payload);
    }
  }
}

function toBase64(bytes) {
  let s = '';
  for (let i = 0; i < bytes.length; i += 0x8000) {
    s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(s);
}

export function fromBase64(b64) {
  const s = atob(b64);
  const out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}

/**
 * An interactive shell on a PTY in the sandbox (what the SDK's `pty.create` does):
 * Process.Start with `pty`, keystrokes with SendInput, resizes with Update, SIGKILL on
 * close. `onOutput(bytes)` gets the terminal's output, `onExit(code|null, why)` its end.
 */
export class PtySession {
  constructor(sandbox, { cols, rows, onOutput, onExit }) {
    this.sandbox = sandbox;
    this.pid = null;
    this.closed = false;
    this.queue = [];
    this.sending = false;
    this.abort = new AbortController();
    this.onOutput = onOutput;
    this.onExit = onExit;
    this.started = new Promise((resolve, reject) => { this._resolve = resolve; this._reject = reject; });
    this._run(cols, rows);
  }

  async _run(cols, rows) {
    const request = {
      process: {
        cmd: '/bin/bash',
        args: ['-i', '-l'],
        envs: { TERM: 'xterm-256color', LANG: 'C.UTF-8', LC_ALL: 'C.UTF-8' },
      },
      pty: { size: { cols, rows } },
    };
    let exit = null;
    try {
      await serverStream(this.sandbox, 'process.Process/Start', request, (m) => {
        const ev = (m.event || {});
        if (ev.start) {
          this.pid = ev.start.pid;
          this._resolve(this.pid);
          this._flush();
        } else if (ev.data) {
          const b = ev.data.pty || ev.data.stdout || ev.data.stderr;
          if (b) this.onOutput(fromBase64(b));
        } else if (ev.end) {
          exit = ev.end.exited ? (ev.end.exitCode || 0) : null;
        }
      }, this.abort.signal);
      this.closed = true;
      this._reject(new Error('the shell ended before it started'));
      this.onExit(exit, exit === null ? 'killed' : `exited with ${exit}`);
    } catch (e) {
      this.closed = true;
      this._reject(e);
      if (e.name !== 'AbortError') this.onExit(null, e.message);
    }
  }

  /** Sends keystrokes (a string or bytes), batched while a call is in flight. */
  write(data) {
    if (this.closed) return;
    this.queue.push(typeof data === 'string' ? new TextEncoder().encode(data) : data);
    this._flush();
  }

  async _flush() {
    if (this.sending || this.pid === null) return;
    this.sending = true;
    try {
      while (this.queue.length && !this.closed) {
        const total = this.queue.reduce((n, b) => n + b.length, 0);
        const bytes = new Uint8Array(total);
        let at = 0;
        for (const b of this.queue.splice(0)) { bytes.set(b, at); at += b.length; }
        await unary(this.sandbox, 'process.Process/SendInput', {
          process: { pid: this.pid },
          input: { pty: toBase64(bytes) },
        });
      }
    } catch (e) {
      if (!this.closed) console.warn('sending input failed', e);
    } finally {
      this.sending = false;
    }
  }

  async resize(cols, rows) {
    if (this.closed || this.pid === null) return;
    try {
      await unary(this.sandbox, 'process.Process/Update', { process: { pid: this.pid }, pty: { size: { cols, rows } } });
    } catch (e) {
      console.warn('resizing failed', e);
    }
  }

  /** Kills the shell (envd keeps processes whose client went away) and stops reading. */
  async close() {
    if (this.closed) return;
    this.closed = true;
    if (this.pid !== null) {
      try {
        await unary(this.sandbox, 'process.Process/SendSignal', { process: { pid: this.pid }, signal: 'SIGNAL_SIGKILL' });
      } catch { /* already gone */ }
    }
    this.abort.abort();
  }
}
