// Line charts drawn by uPlot (vendor/uPlot.iife.min.js, loaded by the page as a script of
// its own before the app's modules): several series on one x axis (training steps). Each
// series keeps its own steps; they are joined into uPlot's one x array when drawn, and a
// line spans the steps where only another series has a point. The chart's root element
// carries data-points (points held) and data-draws (draws done). Away from the cursor, the
// legend shows each series' latest value.

export const PALETTE = [
  "#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#475569", "#ea580c",
];
const HEIGHT = 200;
// Tick steps of an axis whose values are whole numbers (steps, epochs, trial numbers): no
// tick at 0.5 or 1.5.
const INTEGER_INCRS = [];
for (let e = 0; e <= 12; e++) for (const m of [1, 2, 5]) INTEGER_INCRS.push(m * 10 ** e);

export function formatNumber(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(a >= 1e5 ? 0 : 1) + "k";
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2).replace(/\.?0+$/, "");
  if (a >= 1e-3) return v.toPrecision(2);
  return v.toExponential(1);
}

// A tick uPlot leaves unlabelled (a log axis' minor ticks) comes as null: no text.
const ticks = (u, values) => values.map((v) => (v === null ? "" : formatNumber(v)));

export function formatPercent(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  const p = v * 100;
  return `${Math.abs(p) >= 10 || p === 0 ? p.toFixed(0) : p.toFixed(1)}%`;
}

export class LineChart {
  // series: [{name, label, title}] (title: shown on hovering the series' legend). log: a
  // logarithmic y axis (non-positive values are left out); percent: the values are fractions
  // 0-1 shown as percentages. xLabel: what x is (step, epoch); integerX: ticks on whole
  // numbers only.
  constructor(root, { title, series, log = false, percent = false, xLabel = "step", integerX = true }) {
    this.root = root;
    this.root.classList.add("chart");
    this.log = log;
    if (log) this.root.dataset.scale = "log";
    if (percent) this.root.dataset.unit = "percent";
    const fmt = percent ? formatPercent : formatNumber;
    const yTicks = (u, values) => values.map((v) => (v === null ? "" : fmt(v)));
    // The x ticks drawn are kept in data-x-ticks (the canvas has no text to read).
    const xTicks = (u, values) => {
      this.root.dataset.xTicks = values.join(" ");
      return ticks(u, values);
    };
    this.series = series.map((s, i) => ({ ...s, color: s.color || PALETTE[i % PALETTE.length], x: [], y: [] }));
    this.pending = false;
    this.drawCount = 0;
    this.lastDrawMs = 0;
    this.drawStarted = 0;
    this.waiting = [];
    this.width = this.boxWidth();
    this.plot = new globalThis.uPlot(
      {
        title,
        width: this.width,
        height: HEIGHT,
        scales: log ? { x: { time: false }, y: { distr: 3 } } : { x: { time: false } },
        series: [
          { label: xLabel, value: (u, v, i, idx) => formatNumber(idx === null ? this.lastStep() : v) },
          ...this.series.map((s) => ({
            label: s.label,
            stroke: s.color,
            width: 1.5,
            spanGaps: true,
            value: (u, v, i, idx) => fmt(idx === null ? s.y[s.y.length - 1] : v),
          })),
        ],
        axes: [{ values: xTicks, incrs: integerX ? INTEGER_INCRS : undefined }, { values: yTicks, size: 56 }],
        hooks: { draw: [() => this.drawn()] },
      },
      this.data(),
      root,
    );
    // Each series' title (a job's parameters) on its legend entry; the first entry is x.
    const entries = root.querySelectorAll(".u-legend .u-series");
    this.series.forEach((s, i) => {
      if (s.title && entries[i + 1]) entries[i + 1].title = s.title;
    });
    this.observer = new ResizeObserver(() => this.resize());
    this.observer.observe(this.root);
    this.root.dataset.points = "0";
  }

  boxWidth() {
    const style = getComputedStyle(this.root);
    const padding = parseFloat(style.paddingLeft) + parseFloat(style.paddingRight) || 0;
    return Math.max(200, Math.floor(this.root.clientWidth - padding) || 400);
  }

  resize() {
    const width = this.boxWidth();
    if (width === this.width) return;
    this.width = width;
    this.plot.setSize({ width, height: HEIGHT });
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

  lastStep() {
    return this.series.reduce((m, s) => (s.x.length && !(s.x[s.x.length - 1] <= m) ? s.x[s.x.length - 1] : m), undefined);
  }

  points() {
    return this.series.reduce((n, s) => n + s.x.length, 0);
  }

  // uPlot's aligned data: one x array and one y array per series (undefined where a
  // series has no point at that step).
  data() {
    const ys = (s) => (this.log ? s.y.map((v) => (v > 0 ? v : null)) : s.y);
    if (this.series.length === 1) return [this.series[0].x, ys(this.series[0])];
    return globalThis.uPlot.join(this.series.map((s) => [s.x, ys(s)]));
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

  // Gives uPlot the joined data; resolves once uPlot has drawn it (lastDrawMs: join and draw).
  draw() {
    this.drawStarted = performance.now();
    const done = new Promise((resolve) => this.waiting.push(resolve));
    this.plot.setData(this.data());
    return done;
  }

  drawn() {
    if (this.drawStarted) this.lastDrawMs = performance.now() - this.drawStarted;
    this.drawCount += 1;
    this.root.dataset.draws = String(this.drawCount);
    const waiting = this.waiting;
    this.waiting = [];
    waiting.forEach((resolve) => resolve(this.lastDrawMs));
  }

  destroy() {
    this.observer.disconnect();
    this.plot.destroy();
  }
}
