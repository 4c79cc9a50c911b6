// The Cubicle dashboard: one page, views by URL hash (#/sandboxes, #/sandboxes/ID,
// #/host, #/templates, #/keys). It holds the visitor's API key (this tab only, unless
// "remember" is ticked) and uses the server's public API with it, as any client would.
// Text from the server is always set as text, never as HTML.

import { drawChart, drawSpark } from './chart.js';
import { PtySession } from './connect.js';
import { Terminal } from './vendor/xterm.mjs';
import { FitAddon } from './vendor/addon-fit.mjs';

const KEY_NAME = 'cubicle-api-key';
const POLL_MS = 2500;
const HISTORY = 120; // samples kept per sandbox for the sparklines

const state = {
  key: sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME) || '',
  me: null,
  history: new Map(), // sandbox id → [{t, cpu, mem, memTotal}]
};

// ---- small helpers -------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else if (k === 'text') el.textContent = v;
    else el.setAttribute(k, v === true ? '' : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(method, path, body) {
  const headers = { 'X-API-KEY': state.key, Accept: 'application/json' };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!resp.ok) {
    const msg = (data && data.message) || text || resp.statusText;
    throw new ApiError(resp.status, msg);
  }
  return { data, headers: resp.headers };
}

function flash(message, kind) {
  const el = document.getElementById('flash');
  el.textContent = message;
  el.className = kind || '';
  el.hidden = !message;
  clearTimeout(flash.timer);
  if (message) flash.timer = setTimeout(() => { el.hidden = true; }, 8000);
}

function age(iso) {
  const s = Math.max(0, Math.floor((Date.now() - Date.parse(iso)) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

function until(iso) {
  const s = Math.floor((Date.parse(iso) - Date.now()) / 1000);
  if (s <= 0) return 'now';
  if (s < 60) return `in ${s}s`;
  if (s < 3600) return `in ${Math.floor(s / 60)}m`;
  return `in ${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

function mib(bytes) {
  return `${(bytes / 1048576).toFixed(bytes < 10 * 1048576 ? 1 : 0)} MiB`;
}

function when(iso) {
  return iso ? new Date(iso).toLocaleString() : '—';
}

function metaChips(metadata) {
  return Object.entries(metadata || {}).sort().map(([k, v]) => h('span', { class: 'meta', text: `${k}=${v}` }));
}

function stateBadge(s) {
  return h('span', { class: `badge ${s}`, text: s });
}

/** A repeating job that stops when the view goes away. */
function every(ms, fn) {
  let stopped = false;
  let timer = null;
  const tick = async () => {
    if (stopped) return;
    try { await fn(); } catch (e) { handle(e); }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}

function handle(e) {
  if (e instanceof ApiError && e.status === 401) {
    logout('Your API key was refused: log in again.');
    return;
  }
  flash(e.message || String(e));
}

async function action(button, fn) {
  button.disabled = true;
  try { await fn(); } catch (e) { handle(e); } finally { button.disabled = false; }
}

// ---- metrics history -----------------------------------------------------------------

function remember(id, m) {
  let list = state.history.get(id);
  if (!list) state.history.set(id, (list = []));
  if (list.length && list[list.length - 1].t >= m.timestampUnix) return;
  list.push({ t: m.timestampUnix, cpu: m.cpuUsedPct, mem: m.memUsed, memTotal: m.memTotal });
  if (list.length > HISTORY) list.splice(0, list.length - HISTORY);
}

async function latestMetrics(ids) {
  for (let i = 0; i < ids.length; i += 100) {
    const chunk = ids.slice(i, i + 100);
    const { data } = await api('GET', `/sandboxes/metrics?sandbox_ids=${chunk.map(encodeURIComponent).join(',')}`);
    for (const [id, m] of Object.entries((data && data.sandboxes) || {})) remember(id, m);
  }
}

function usageCells(id) {
  const list = state.history.get(id) || [];
  const last = list[list.length - 1];
  const cpu = h('canvas', { class: 'spark' });
  const mem = h('canvas', { class: 'spark' });
  requestAnimationFrame(() => {
    drawSpark(cpu, list.map((s) => s.cpu), 100, '#2f6fde');
    drawSpark(mem, list.map((s) => s.mem), last ? last.memTotal : 0, '#1f8a4c');
  });
  return [
    h('td', { class: 'num', 'data-col': 'cpu' }, cpu, ' ', last ? `${last.cpu.toFixed(1)}%` : '—'),
    h('td', { class: 'num', 'data-col': 'mem' }, mem, ' ', last ? mib(last.mem) : '—'),
  ];
}

// ---- views ---------------------------------------------------------------------------

function loginView(main) {
  const input = h('input', { id: 'api-key', type: 'password', placeholder: 'e2b_…', autocomplete: 'off', value: '' });
  const rememberBox = h('input', { id: 'remember', type: 'checkbox' });
  const form = h('form', {
    class: 'card login',
    onsubmit: async (ev) => {
      ev.preventDefault();
      state.key = input.value.trim();
      try {
        await login(rememberBox.checked);
        location.hash = '#/sandboxes';
      } catch (e) {
        state.key = '';
        flash(e instanceof ApiError && e.status === 401 ? 'That API key was refused.' : e.message);
      }
    },
  },
  h('h1', { text: 'Log in' }),
  h('p', { class: 'muted', text: 'With an API key of this server: `cubicle apikey` prints the operator\'s, `cubicle apikey create --team NAME` makes one for a team.' }),
  input,
  h('label', {}, rememberBox, ' Remember on this computer'),
  h('div', {}, h('button', { class: 'primary', id: 'login', type: 'submit', text: 'Log in' })));
  main.append(form);
  input.focus();
}

async function login(persist) {
  const { data } = await api('GET', '/cubicle/whoami');
  state.me = data;
  sessionStorage.setItem(KEY_NAME, state.key);
  if (persist) localStorage.setItem(KEY_NAME, state.key);
  showIdentity();
}

function showIdentity() {
  const me = state.me;
  document.getElementById('nav').hidden = !me;
  document.getElementById('logout').hidden = !me;
  document.getElementById('nav-host').hidden = !(me && me.admin);
  const who = document.getElementById('who');
  who.replaceChildren();
  if (me) {
    who.append('team ', h('strong', { id: 'team', text: me.team }), ' ');
    if (me.admin) who.append(h('span', { class: 'badge admin', text: 'operator' }));
  }
}

function logout(message) {
  state.key = '';
  state.me = null;
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
  showIdentity();
  location.hash = '#/login';
  if (message) flash(message);
}

async function listAll(path) {
  const out = [];
  let token = null;
  for (let page = 0; page < 50; page++) {
    const sep = path.includes('?') ? '&' : '?';
    const { data, headers } = await api('GET', path + (token ? `${sep}nextToken=${encodeURIComponent(token)}` : ''));
    out.push(...data);
    token = headers.get('x-next-token');
    if (!token) break;
  }
  return out;
}

async function pauseOrResume(id, what) {
  await api('POST', `/sandboxes/${encodeURIComponent(id)}/${what}`, what === 'resume' ? {} : undefined);
  flash(`${what === 'pause' ? 'Paused' : 'Resumed'} ${id}`, 'info');
}

async function kill(id, path) {
  if (!confirm(`Kill sandbox ${id}? Everything in it is lost.`)) return false;
  await api('DELETE', path || `/sandboxes/${encodeURIComponent(id)}`);
  state.history.delete(id);
  flash(`Killed ${id}`, 'info');
  return true;
}

function sandboxesView(main) {
  const tbody = h('tbody');
  const count = h('span', { class: 'muted', id: 'count' });
  const limits = state.me.limits;
  const tpl = h('input', { id: 'new-template', value: 'base', size: 14 });
  const timeout = h('input', { id: 'new-timeout', type: 'number', min: 1, max: limits.maxTimeout, value: 300, style: 'width:90px' });
  const cpus = h('input', { id: 'new-cpus', type: 'number', min: 1, max: limits.maxCpus, placeholder: 'template', style: 'width:90px' });
  const mem = h('input', { id: 'new-memory', type: 'number', min: 128, max: limits.maxMemoryMB, placeholder: 'template', style: 'width:100px' });
  const createBtn = h('button', { class: 'primary', id: 'create', type: 'submit', text: 'Create' });
  const form = h('form', {
    class: 'inline card',
    onsubmit: (ev) => {
      ev.preventDefault();
      action(createBtn, async () => {
        const body = { templateID: tpl.value.trim(), timeout: Number(timeout.value) || 300, metadata: { createdBy: 'dashboard' } };
        if (cpus.value) body.cpuCount = Number(cpus.value);
        if (mem.value) body.memoryMB = Number(mem.value);
        const { data } = await api('POST', '/v2/sandboxes', body);
        flash(`Created ${data.sandboxID}`, 'info');
        refresh();
      });
    },
  },
  h('label', { class: 'field' }, 'Template', tpl),
  h('label', { class: 'field' }, 'Timeout (s)', timeout),
  h('label', { class: 'field' }, `vCPUs (≤ ${limits.maxCpus})`, cpus),
  h('label', { class: 'field' }, `Memory MiB (≤ ${limits.maxMemoryMB})`, mem),
  createBtn);

  main.append(
    h('div', { class: 'toolbar' }, h('h1', { text: 'Sandboxes' }), count),
    form,
    h('table', { id: 'sandboxes' },
      h('thead', {}, h('tr', {}, ...['Sandbox', 'Template', 'State', 'Age', 'Ends', 'CPU', 'Memory', 'Metadata', ''].map((t) => h('th', { text: t })))),
      tbody),
  );

  async function refresh() {
    const items = await listAll('/v2/sandboxes?state=running,paused&limit=100');
    const running = items.filter((s) => s.state === 'running').map((s) => s.sandboxID);
    if (running.length) await latestMetrics(running);
    count.textContent = `${items.length} sandbox${items.length === 1 ? '' : 'es'}`;
    items.sort((a, b) => Date.parse(b.startedAt) - Date.parse(a.startedAt));
    tbody.replaceChildren(...items.map((s) => {
      const id = s.sandboxID;
      const killBtn = h('button', { class: 'danger', 'data-action': 'kill', text: 'Kill' });
      killBtn.addEventListener('click', () => action(killBtn, async () => { if (await kill(id)) refresh(); }));
      const pauseBtn = h('button', { 'data-action': s.state === 'paused' ? 'resume' : 'pause', text: s.state === 'paused' ? 'Resume' : 'Pause' });
      pauseBtn.addEventListener('click', () => action(pauseBtn, async () => { await pauseOrResume(id, s.state === 'paused' ? 'resume' : 'pause'); refresh(); }));
      return h('tr', { 'data-id': id },
        h('td', { class: 'mono' }, h('a', { href: `#/sandboxes/${encodeURIComponent(id)}`, text: id })),
        h('td', { text: s.alias || s.templateID }),
        h('td', {}, stateBadge(s.state)),
        h('td', { 'data-col': 'age', text: age(s.startedAt) }),
        h('td', { text: until(s.endAt) }),
        ...usageCells(id),
        h('td', {}, metaChips(s.metadata)),
        h('td', {}, pauseBtn, ' ', killBtn));
    }));
    if (!items.length) tbody.append(h('tr', {}, h('td', { colspan: 9, class: 'muted', text: 'No sandboxes yet: create one above or with an SDK.' })));
  }
  return every(POLL_MS, refresh);
}

function hostView(main) {
  if (!state.me.admin) {
    main.append(h('p', { text: 'The view across teams is for the operator\'s key.' }));
    return () => {};
  }
  const tbody = h('tbody');
  main.append(
    h('h1', { text: 'All sandboxes on this host' }),
    h('p', { class: 'muted', text: 'Every team\'s live sandboxes. Killing one here is as if its team had killed it.' }),
    h('table', { id: 'host-sandboxes' },
      h('thead', {}, h('tr', {}, ...['Team', 'Sandbox', 'Template', 'Age', 'Ends', 'vCPUs', 'Memory', 'Metadata', ''].map((t) => h('th', { text: t })))),
      tbody));
  async function refresh() {
    const { data } = await api('GET', '/cubicle/sandboxes');
    tbody.replaceChildren(...data.map((s) => {
      const btn = h('button', { class: 'danger', 'data-action': 'kill', text: 'Kill' });
      btn.addEventListener('click', () => action(btn, async () => {
        if (await kill(s.sandboxID, `/cubicle/sandboxes/${encodeURIComponent(s.sandboxID)}`)) refresh();
      }));
      return h('tr', { 'data-id': s.sandboxID },
        h('td', { text: s.team }),
        h('td', { class: 'mono', text: s.sandboxID }),
        h('td', { text: s.alias || s.templateID }),
        h('td', { text: age(s.startedAt) }),
        h('td', { text: until(s.endAt) }),
        h('td', { class: 'num', text: s.cpuCount }),
        h('td', { class: 'num', text: `${s.memoryMB} MiB` }),
        h('td', {}, metaChips(s.metadata)),
        h('td', {}, btn));
    }));
    if (!data.length) tbody.append(h('tr', {}, h('td', { colspan: 9, class: 'muted', text: 'No sandboxes on this host.' })));
  }
  return every(POLL_MS, refresh);
}

function detailView(main, id) {
  const stops = [];
  const facts = h('dl', { class: 'facts', id: 'facts' });
  const title = h('h1', { class: 'mono', text: id });
  const badge = h('span');
  const cpuCanvas = h('canvas', { class: 'chart', id: 'cpu-chart' });
  const memCanvas = h('canvas', { class: 'chart', id: 'mem-chart' });
  const cpuNow = h('span', { class: 'muted', id: 'cpu-now' });
  const memNow = h('span', { class: 'muted', id: 'mem-now' });
  const logs = h('pre', { class: 'logs', id: 'logs' });
  const termBox = h('div', { id: 'terminal', hidden: true });
  const termStatus = h('span', { class: 'muted', id: 'terminal-status' });
  const user = h('select', { id: 'terminal-user' }, h('option', { value: '', text: 'default user' }), h('option', { value: 'root', text: 'root' }));
  const openBtn = h('button', { class: 'primary', id: 'open-terminal', text: 'Open terminal' });
  const closeBtn = h('button', { id: 'close-terminal', text: 'Close terminal', hidden: true });
  const killBtn = h('button', { class: 'danger', id: 'kill', text: 'Kill' });
  const pauseBtn = h('button', { id: 'pause', text: 'Pause' });
  const extendBtn = h('button', { id: 'extend', text: '+5 min' });
  let detail = null;
  let session = null;
  let term = null;

  main.append(
    h('p', {}, h('a', { href: '#/sandboxes', text: '← Sandboxes' })),
    h('div', { class: 'toolbar' }, title, badge, h('span', { class: 'spacer' }), extendBtn, pauseBtn, killBtn),
    h('div', { class: 'card' }, facts),
    h('div', { class: 'grid2' },
      h('div', { class: 'card' }, h('h2', {}, 'CPU ', cpuNow), cpuCanvas),
      h('div', { class: 'card' }, h('h2', {}, 'Memory ', memNow), memCanvas)),
    h('div', { class: 'card' },
      h('div', { class: 'toolbar' }, h('h2', { text: 'Terminal' }), user, openBtn, closeBtn, termStatus),
      termBox),
    h('div', { class: 'card' }, h('h2', { text: 'Logs' }), logs));

  killBtn.addEventListener('click', () => action(killBtn, async () => {
    if (await kill(id)) location.hash = '#/sandboxes';
  }));
  pauseBtn.addEventListener('click', () => action(pauseBtn, async () => {
    await pauseOrResume(id, detail && detail.state === 'paused' ? 'resume' : 'pause');
    await loadDetail();
  }));
  extendBtn.addEventListener('click', () => action(extendBtn, async () => {
    const left = Math.max(0, Math.floor((Date.parse(detail.endAt) - Date.now()) / 1000));
    await api('POST', `/sandboxes/${encodeURIComponent(id)}/timeout`, { timeout: Math.min(left + 300, state.me.limits.maxTimeout) });
    await loadDetail();
  }));

  async function loadDetail() {
    const { data } = await api('GET', `/sandboxes/${encodeURIComponent(id)}`);
    detail = data;
    badge.replaceChildren(stateBadge(data.state));
    pauseBtn.textContent = data.state === 'paused' ? 'Resume' : 'Pause';
    openBtn.disabled = data.state !== 'running' || !!session;
    const rows = [
      ['Template', data.alias ? `${data.alias} (${data.templateID})` : data.templateID],
      ['Started', `${when(data.startedAt)} (${age(data.startedAt)} ago)`],
      ['Ends', `${when(data.endAt)} (${until(data.endAt)})`],
      ['vCPUs', data.cpuCount],
      ['Memory', `${data.memoryMB} MiB`],
      ['Disk', `${data.diskSizeMB} MiB`],
      ['Internet', data.allowInternetAccess === false ? 'no' : 'yes'],
      ['envd', data.envdVersion],
    ];
    facts.replaceChildren(...rows.flatMap(([k, v]) => [h('dt', { text: k }), h('dd', { text: v })]),
      h('dt', { text: 'Metadata' }), h('dd', { id: 'metadata' }, metaChips(data.metadata)));
  }

  let samples = [];
  async function loadMetrics() {
    if (!detail || detail.state !== 'running') return;
    const { data } = await api('GET', `/sandboxes/${encodeURIComponent(id)}/metrics`);
    samples = data;
    const last = data[data.length - 1];
    cpuNow.textContent = last ? `${last.cpuUsedPct.toFixed(1)}% of ${last.cpuCount} vCPU` : '';
    memNow.textContent = last ? `${mib(last.memUsed)} of ${mib(last.memTotal)}` : '';
    cpuCanvas.dataset.samples = String(data.length);
    memCanvas.dataset.samples = String(data.length);
    draw();
  }
  function draw() {
    const last = samples[samples.length - 1];
    drawChart(cpuCanvas, samples.map((m) => [m.timestampUnix, m.cpuUsedPct]), { max: 100, color: '#2f6fde', format: (v) => `${v.toFixed(0)}%` });
    drawChart(memCanvas, samples.map((m) => [m.timestampUnix, m.memUsed / 1048576]), { max: last ? last.memTotal / 1048576 : 0, color: '#1f8a4c', format: (v) => `${v.toFixed(0)} MiB` });
  }
  window.addEventListener('resize', draw);
  stops.push(() => window.removeEventListener('resize', draw));

  let cursor = null;
  let seenAtCursor = 0;
  async function loadLogs() {
    const q = `direction=forward&limit=1000${cursor !== null ? `&cursor=${cursor}` : ''}`;
    const { data } = await api('GET', `/v2/sandboxes/${encodeURIComponent(id)}/logs?${q}`);
    let skip = seenAtCursor;
    const atBottom = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
    for (const e of data.logs || []) {
      const t = Date.parse(e.timestamp);
      if (cursor !== null && t === cursor && skip > 0) { skip--; continue; }
      if (t !== cursor) { cursor = t; seenAtCursor = 0; }
      seenAtCursor++;
      logs.append(`${new Date(t).toLocaleTimeString()} ${e.level.padEnd(5)} ${e.message}\n`);
    }
    if (atBottom) logs.scrollTop = logs.scrollHeight;
  }

  openBtn.addEventListener('click', () => {
    if (session || !detail) return;
    termBox.hidden = false;
    term = new Terminal({ cursorBlink: true, fontSize: 13, convertEol: false, scrollback: 5000 });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(termBox);
    fit.fit();
    window.cubicleTerminal = term; // for tests and the curious: the buffer is readable
    termStatus.textContent = 'connecting…';
    session = new PtySession(
      { id, token: detail.envdAccessToken, user: user.value || undefined },
      {
        cols: term.cols,
        rows: term.rows,
        onOutput: (bytes) => term.write(bytes),
        onExit: (code, why) => {
          termStatus.textContent = `shell ended (${why})`;
          termBox.dataset.state = 'ended';
          session = null;
          openBtn.disabled = false;
          closeBtn.hidden = true;
        },
      });
    session.started.then(() => {
      termStatus.textContent = 'connected';
      termBox.dataset.state = 'connected';
      term.focus();
    }, () => {});
    term.onData((d) => session && session.write(d));
    term.onResize(({ cols, rows }) => session && session.resize(cols, rows));
    const onResize = () => fit.fit();
    window.addEventListener('resize', onResize);
    stops.push(() => window.removeEventListener('resize', onResize));
    openBtn.disabled = true;
    closeBtn.hidden = false;
  });
  closeBtn.addEventListener('click', () => {
    if (session) session.close();
    session = null;
    termStatus.textContent = 'closed';
    closeBtn.hidden = true;
    openBtn.disabled = !detail || detail.state !== 'running';
  });
  stops.push(() => { if (session) session.close(); if (term) term.dispose(); });

  stops.push(every(POLL_MS * 2, loadDetail));
  stops.push(every(POLL_MS, loadMetrics));
  stops.push(every(POLL_MS, loadLogs));
  return () => stops.forEach((s) => s());
}

function templatesView(main) {
  const pools = h('tbody');
  const templates = h('div', { id: 'templates' });
  main.append(
    h('h1', { text: 'Templates' }),
    templates,
    h('h2', { text: 'Warm pools' }),
    h('p', { class: 'muted', text: 'Sandboxes started ahead of time, handed out by creates of their template in milliseconds.' }),
    h('table', { id: 'pools' }, h('thead', {}, h('tr', {}, ...['Template', 'Ready', 'Target'].map((t) => h('th', { text: t })))), pools),
    h('p', { class: 'muted', id: 'pool-counters' }));

  async function loadTemplates() {
    // The node's templates every team may use, then the team's own (built with the SDK's
    // Template builder; E2B's `GET /templates` lists only those).
    let list;
    try {
      const [shared, own] = await Promise.all([api('GET', '/default-templates'), api('GET', '/templates')]);
      list = [...shared.data, ...own.data];
    } catch (e) {
      if (e instanceof ApiError && (e.status === 404 || e.status === 405)) {
        templates.replaceChildren(h('p', { class: 'muted', id: 'templates-unavailable', text: 'This server does not list templates over its API; `cubicle template list` shows the ones on the host.' }));
        return;
      }
      throw e;
    }
    // Its latest build: its state, when and by what it was built, and its size.
    templates.replaceChildren(h('table', { id: 'template-list' },
      h('thead', {}, h('tr', {}, ...['Template', 'Aliases', 'Owner', 'Status', 'vCPUs', 'Memory', 'Disk', 'Size', 'Built', 'Build'].map((t) => h('th', { text: t })))),
      h('tbody', {}, ...list.map((t) => h('tr', { 'data-id': t.templateID },
        h('td', { class: 'mono', text: t.templateID }),
        h('td', { text: (t.aliases || []).join(', ') }),
        h('td', { text: t.isDefault || t.public ? 'everyone' : 'your team' }),
        h('td', {}, t.buildStatus ? stateBadge(t.buildStatus) : ''),
        h('td', { class: 'num', text: t.cpuCount ?? '' }),
        h('td', { class: 'num', text: t.memoryMB ? `${t.memoryMB} MiB` : '' }),
        h('td', { class: 'num', text: t.diskSizeMB ? `${t.diskSizeMB} MiB` : '' }),
        h('td', { class: 'num', text: t.sizeBytes ? mib(t.sizeBytes) : '' }),
        h('td', { text: when(t.updatedAt || t.createdAt) }),
        h('td', { class: 'mono', text: [t.buildID, t.builder].filter(Boolean).join(' · ') }))))));
  }

  async function loadPools() {
    const { data } = await api('GET', '/cubicle/pool');
    const names = [...new Set([...Object.keys(data.target || {}), ...Object.keys(data.ready || {})])].sort();
    pools.replaceChildren(...names.map((n) => h('tr', { 'data-template': n },
      h('td', { text: n }), h('td', { class: 'num', text: (data.ready || {})[n] || 0 }), h('td', { class: 'num', text: (data.target || {})[n] || 0 }))));
    if (!names.length) pools.append(h('tr', {}, h('td', { colspan: 3, class: 'muted', text: 'No warm pools (cubicle serve --pool TEMPLATE=N).' })));
    document.getElementById('pool-counters').textContent = `Creates served from a pool: ${data.claims}; found it empty: ${data.misses}; pooled sandboxes made: ${data.refills}.`;
  }

  loadTemplates().catch(handle);
  return every(POLL_MS * 2, loadPools);
}

function keysView(main) {
  const tbody = h('tbody');
  const shown = h('div', { id: 'new-key' });
  const team = h('input', { id: 'key-team', value: state.me.team, size: 16, disabled: !state.me.admin });
  const btn = h('button', { class: 'primary', id: 'create-key', type: 'submit', text: 'Create key' });
  main.append(
    h('h1', { text: 'API keys' }),
    h('p', { class: 'muted', text: state.me.admin ? 'Every team\'s keys (you hold the operator\'s). A new team is created with its first key.' : `The keys of team ${state.me.team}.` }),
    h('form', {
      class: 'inline card',
      onsubmit: (ev) => {
        ev.preventDefault();
        action(btn, async () => {
          const { data } = await api('POST', '/cubicle/api-keys', { team: team.value.trim() });
          shown.replaceChildren(h('div', { class: 'newkey' },
            h('strong', { text: `New key for team ${data.team}: ` }), h('span', { class: 'mono', id: 'new-key-value', text: data.key }),
            h('div', { class: 'muted', text: 'Shown only now: copy it somewhere safe.' })));
          await refresh();
        });
      },
    }, h('label', { class: 'field' }, 'Team', team), btn),
    shown,
    h('table', { id: 'keys' },
      h('thead', {}, h('tr', {}, ...['Key', 'Team', 'Created', 'Last used', 'Status', ''].map((t) => h('th', { text: t })))),
      tbody));
  async function refresh() {
    const { data } = await api('GET', '/cubicle/api-keys');
    tbody.replaceChildren(...data.map((k) => {
      const mine = state.key.startsWith(k.prefix);
      const revoke = h('button', { class: 'danger', 'data-action': 'revoke', text: 'Revoke', disabled: !!k.revokedAt || mine, title: mine ? 'the key you are logged in with' : null });
      revoke.addEventListener('click', () => action(revoke, async () => {
        if (!confirm(`Revoke ${k.prefix}…? Clients using it stop working at once.`)) return;
        await api('DELETE', `/cubicle/api-keys/${encodeURIComponent(k.prefix)}`);
        await refresh();
      }));
      return h('tr', { 'data-prefix': k.prefix },
        h('td', { class: 'mono', text: `${k.prefix}…` }),
        h('td', { text: k.team }),
        h('td', { text: when(k.createdAt) }),
        h('td', { text: when(k.lastUsedAt) }),
        h('td', {}, k.revokedAt ? stateBadge('revoked') : h('span', { class: 'badge running', text: mine ? 'active (yours)' : 'active' })),
        h('td', {}, revoke));
    }));
  }
  refresh().catch(handle);
  return () => {};
}

// ---- routing -------------------------------------------------------------------------

let cleanup = () => {};

async function route() {
  cleanup();
  cleanup = () => {};
  const main = document.getElementById('main');
  main.replaceChildren();
  const [, view, arg] = (location.hash || '#/sandboxes').split('/');
  if (!state.me && state.key) {
    try { await login(false); } catch { logout(); return; }
  }
  if (!state.me) {
    if (view !== 'login') { location.hash = '#/login'; return; }
    loginView(main);
    return;
  }
  document.querySelectorAll('#nav a').forEach((a) => a.classList.toggle('active', a.dataset.view === view));
  switch (view) {
    case 'sandboxes':
      cleanup = arg ? detailView(main, decodeURIComponent(arg)) : sandboxesView(main);
      break;
    case 'host': cleanup = hostView(main); break;
    case 'templates': cleanup = templatesView(main); break;
    case 'keys': cleanup = keysView(main); break;
    default: location.hash = '#/sandboxes';
  }
}

document.getElementById('logout').addEventListener('click', () => logout());
window.addEventListener('hashchange', route);
route();
