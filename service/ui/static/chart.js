// A small canvas line chart: several series on one x axis (training steps), auto-scaled
// axes with round ticks, a legend, and drawing cost bounded by the canvas width rather
// than the number of points (each pixel column draws its lowest and highest value).

const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];

function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  const nice = norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10;
  return nice * mag;
}

function ticks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const step = niceStep(hi - lo, count);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}

export function formatNumber(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(a >= 1e5 ? 0 : 1) + "k";
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2).replace(/\.?0+$/, "");
  if (a >= 1e-3) return v.toPrecision(2);
  return v.toExponential(1);
}

export class LineChart {
  // series: [{name, label}]; the chart's root element carries data-points (points held).
  constructor(root, { title, series }) {
    this.root = root;
    this.root.classList.add("chart");
    this.series = series.map((s, i) => ({ ...s, color: PALETTE[i % PALETTE.length], x: [], y: [] }));
    const head = document.createElement("div");
    head.className = "chart-title";
    head.textContent = title;
    this.canvas = document.createElement("canvas");
    this.legend = document.createElement("div");
    this.legend.className = "chart-legend";
    root.append(head, this.canvas, this.legend);
    this.pending = false;
    this.drawCount = 0;
    this.observer = new ResizeObserver(() => this.schedule());
    this.observer.observe(this.root);
    this.renderLegend();
  }

  byName(name) {
    return this.series.find((s) => s.name === name);
  }

  has(name) {
    return this.byName(name) !== undefined;
  }

  setData(name, xs, ys) {
    const s = this.byName(name);
    if (!s) return;
    s.x = Array.from(xs);
    s.y = Array.from(ys);
    this.schedule();
  }

  append(name, x, y) {
    const s = this.byName(name);
    if (!s || !Number.isFinite(y)) return;
    s.x.push(x);
    s.y.push(y);
    this.schedule();
  }

  points() {
    return this.series.reduce((n, s) => n + s.x.length, 0);
  }

  schedule() {
    this.root.dataset.points = String(this.points());
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.draw();
    });
  }

  renderLegend() {
    this.legend.replaceChildren(
      ...this.series.map((s) => {
        const item = document.createElement("span");
        item.className = "legend-item";
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.backgroundColor = s.color;
        const last = s.y.length ? ` ${formatNumber(s.y[s.y.length - 1])}` : "";
        item.append(swatch, document.createTextNode(`${s.label}${last}`));
        return item;
      }),
    );
  }

  draw() {
    const started = performance.now();
    const rect = this.canvas.getBoundingClientRect();
    const dpr = window.devicePixelRatio || 1;
    const width = Math.max(200, Math.round(rect.width || 400));
    const height = Math.max(120, Math.round(rect.height || 200));
    this.canvas.width = width * dpr;
    this.canvas.height = height * dpr;
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const pad = { left: 52, right: 12, top: 8, bottom: 24 };
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;

    let xmin = Infinity, xmax = -Infinity, ymin = Infinity, ymax = -Infinity;
    for (const s of this.series) {
      if (!s.x.length) continue;
      xmin = Math.min(xmin, s.x[0]);
      xmax = Math.max(xmax, s.x[s.x.length - 1]);
      for (const v of s.y) {
        if (v < ymin) ymin = v;
        if (v > ymax) ymax = v;
      }
    }
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#6b7280";
    if (!Number.isFinite(xmin)) {
      ctx.fillText("no points yet", pad.left + 8, pad.top + plotH / 2);
      this.renderLegend();
      this.lastDrawMs = performance.now() - started;
      return;
    }
    if (xmax === xmin) xmax = xmin + 1;
    if (ymax === ymin) {
      ymax += Math.abs(ymax) * 0.05 || 1;
      ymin -= Math.abs(ymin) * 0.05 || 1;
    }
    const margin = (ymax - ymin) * 0.05;
    ymin -= margin;
    ymax += margin;
    const px = (x) => pad.left + ((x - xmin) / (xmax - xmin)) * plotW;
    const py = (y) => pad.top + (1 - (y - ymin) / (ymax - ymin)) * plotH;

    ctx.strokeStyle = "#e5e7eb";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const t of ticks(ymin, ymax, 4)) {
      const y = Math.round(py(t)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(pad.left, y);
      ctx.lineTo(pad.left + plotW, y);
      ctx.stroke();
      ctx.fillText(formatNumber(t), pad.left - 6, y);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (const t of ticks(xmin, xmax, 6)) {
      ctx.fillText(formatNumber(t), px(t), pad.top + plotH + 6);
    }

    ctx.save();
    ctx.beginPath();
    ctx.rect(pad.left, pad.top, plotW, plotH);
    ctx.clip();
    ctx.lineWidth = 1.5;
    for (const s of this.series) {
      const n = s.x.length;
      if (!n) continue;
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      if (n === 1) {
        ctx.fillRect(px(s.x[0]) - 2, py(s.y[0]) - 2, 4, 4);
        continue;
      }
      ctx.beginPath();
      // One vertical stroke per pixel column (its min and max) once points outnumber pixels.
      let col = Math.floor(px(s.x[0]));
      let lo = s.y[0], hi = s.y[0], first = s.y[0], last = s.y[0];
      ctx.moveTo(px(s.x[0]), py(first));
      const flush = () => {
        ctx.lineTo(col, py(first));
        if (hi !== lo) {
          ctx.lineTo(col, py(lo));
          ctx.lineTo(col, py(hi));
        }
        ctx.lineTo(col, py(last));
      };
      for (let i = 1; i < n; i++) {
        const c = Math.floor(px(s.x[i]));
        const v = s.y[i];
        if (c === col) {
          if (v < lo) lo = v;
          if (v > hi) hi = v;
          last = v;
          continue;
        }
        flush();
        col = c;
        lo = hi = first = last = v;
      }
      flush();
      ctx.stroke();
      if (n < 60) {
        for (let i = 0; i < n; i++) ctx.fillRect(px(s.x[i]) - 1.5, py(s.y[i]) - 1.5, 3, 3);
      }
    }
    ctx.restore();
    this.renderLegend();
    this.drawCount += 1;
    this.root.dataset.draws = String(this.drawCount);
    this.lastDrawMs = performance.now() - started;
  }

  destroy() {
    this.observer.disconnect();
  }
}
