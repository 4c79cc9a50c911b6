// A small line chart on a <canvas>: a series of [unixSeconds, value] points, a fixed
// y range (0..max), the latest value as the caption. Redrawn whole on every update.

const PAD = { left: 44, right: 8, top: 8, bottom: 18 };

function fmtTime(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 8);
}

/**
 * Draws `points` on `canvas`. `opts`: { max, color, format(v) → label, title }.
 */
export function drawChart(canvas, points, opts) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 320;
  const h = canvas.clientHeight || 120;
  if (canvas.width !== w * dpr || canvas.height !== h * dpr) {
    canvas.width = w * dpr;
    canvas.height = h * dpr;
  }
  const g = canvas.getContext('2d');
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const fmt = opts.format || ((v) => String(v));
  const max = Math.max(opts.max || 0, ...points.map((p) => p[1]), 1e-9);
  const x0 = PAD.left, x1 = w - PAD.right, y0 = h - PAD.bottom, y1 = PAD.top;
  g.font = '11px system-ui, sans-serif';
  g.fillStyle = '#8a94a6';
  g.strokeStyle = '#e3e7ee';
  g.lineWidth = 1;
  for (const f of [0, 0.5, 1]) {
    const y = y0 - (y0 - y1) * f;
    g.beginPath();
    g.moveTo(x0, y);
    g.lineTo(x1, y);
    g.stroke();
    g.textAlign = 'right';
    g.fillText(fmt(max * f), x0 - 4, y + 4);
  }
  if (points.length === 0) {
    g.textAlign = 'center';
    g.fillText('waiting for samples…', (x0 + x1) / 2, (y0 + y1) / 2);
    return;
  }
  const t0 = points[0][0];
  const t1 = Math.max(points[points.length - 1][0], t0 + 1);
  const px = (t) => x0 + ((t - t0) / (t1 - t0)) * (x1 - x0);
  const py = (v) => y0 - (v / max) * (y0 - y1);
  g.textAlign = 'left';
  g.fillText(fmtTime(t0), x0, h - 4);
  g.textAlign = 'right';
  g.fillText(fmtTime(t1), x1, h - 4);
  g.strokeStyle = opts.color || '#2f6fde';
  g.lineWidth = 2;
  g.beginPath();
  points.forEach(([t, v], i) => (i ? g.lineTo(px(t), py(v)) : g.moveTo(px(t), py(v))));
  if (points.length === 1) g.lineTo(px(t0) + 2, py(points[0][1]));
  g.stroke();
  g.globalAlpha = 0.12;
  g.fillStyle = opts.color || '#2f6fde';
  g.lineTo(px(points[points.length - 1][0]), y0);
  g.lineTo(px(t0), y0);
  g.closePath();
  g.fill();
  g.globalAlpha = 1;
}

/** A tiny sparkline (no axes) for table cells. */
export function drawSpark(canvas, values, max, color) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 80;
  const h = canvas.clientHeight || 20;
  canvas.width = w * dpr;
  canvas.height = h * dpr;
  const g = canvas.getContext('2d');
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  if (!values.length) return;
  const m = Math.max(max || 0, ...values, 1e-9);
  g.strokeStyle = color || '#2f6fde';
  g.lineWidth = 1.5;
  g.beginPath();
  values.forEach((v, i) => {
    const x = values.length === 1 ? w / 2 : (i / (values.length - 1)) * (w - 2) + 1;
    const y = h - 1 - (v / m) * (h - 2);
    if (i) g.lineTo(x, y); else g.moveTo(x, y);
  });
  g.stroke();
}
