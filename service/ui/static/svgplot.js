// Small SVG charts drawn without a library: a scatter of points (a sweep's objective against
// a parameter) and parallel coordinates (many runs at once: one vertical axis per parameter
// and metric, one line per run). Each has its axes' ticks on round numbers ("nice" ticks),
// integer axes only whole numbers, log axes powers of ten, and categorical axes one tick per
// value. Everything is built with createElementNS and textContent.

import { sig } from "./dom.js";

const NS = "http://www.w3.org/2000/svg";

export function svg(tag, attrs = {}, text) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

// At least `count` round values within [lo, hi] (steps of 1, 2, 2.5 or 5 × 10^k, the largest
// that gives that many; whole numbers only where `integer`, which may give fewer).
export function niceTicks(lo, hi, count = 5, integer = false) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [];
  if (lo === hi) return [lo];
  const within = (step) => {
    const out = [];
    for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  };
  const top = Math.floor(Math.log10(hi - lo));
  let best = null;
  for (let e = top - 2; e <= top; e++) {
    for (const m of [1, 2, 2.5, 5]) {
      const step = m * 10 ** e;
      if (integer && !Number.isInteger(+step.toPrecision(12))) continue;
      const ticks = within(step);
      if (ticks.length >= count) best = ticks;
    }
  }
  if (best) return best;
  return integer ? within(1) : within(10 ** (top - 2));
}

// A numeric scale: value → [0, 1], with ticks; log where asked (and every value > 0).
function numericScale(values, { log = false, integer = false, pad = 0.06 } = {}) {
  const finite = values.filter((v) => typeof v === "number" && Number.isFinite(v) && (!log || v > 0));
  if (!finite.length) return null;
  const f = log ? Math.log10 : (v) => v;
  let lo = f(Math.min(...finite));
  let hi = f(Math.max(...finite));
  if (lo === hi) {
    const spread = log ? 0.5 : Math.abs(lo) * 0.1 || 1;
    lo -= spread;
    hi += spread;
  }
  // A little room at both ends: no point sits on an axis.
  const room = (hi - lo) * pad;
  lo -= room;
  hi += room;
  let ticks;
  if (log) {
    ticks = [];
    for (let e = Math.ceil(lo); e <= Math.floor(hi); e++) ticks.push(10 ** e);
    if (ticks.length < 3) ticks = niceTicks(10 ** lo, 10 ** hi, 5).filter((t) => t > 0);
  } else {
    ticks = niceTicks(lo, hi, 5, integer);
  }
  const at = (v) => (typeof v === "number" && Number.isFinite(v) && (!log || v > 0) ? (f(v) - lo) / (hi - lo) : null);
  return { at, ticks: ticks.filter((t) => at(t) !== null && at(t) >= -1e-9 && at(t) <= 1 + 1e-9) };
}

// A categorical scale: each distinct value (in the order given) at an even spacing.
function categoryScale(values) {
  const cats = [...new Set(values.filter((v) => v !== null && v !== undefined).map(String))];
  if (!cats.length) return null;
  const at = (v) => (v === null || v === undefined ? null : (cats.indexOf(String(v)) + 0.5) / cats.length);
  return { at, ticks: cats, categorical: true };
}

function scaleOf(values, opts = {}) {
  const numeric = values.every((v) => v === null || v === undefined || typeof v === "number");
  return numeric ? numericScale(values, opts) : categoryScale(values);
}

function shorten(text, n) {
  const t = String(text);
  return t.length > n ? `${t.slice(0, n - 1)}…` : t;
}

// points: [{x, y, label, best}]. x: numbers or categories; y: numbers. fmtX, fmtY format the
// ticks and the tooltips; the best point is drawn as a ring around its dot, so a point under
// it stays visible.
export function scatter({ id, title, xLabel, points, log = false, integerX = false, fmtX = sig, fmtY = sig }) {
  const W = 340, H = 230, L = 52, R = 14, T = 24, B = 40;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "scatter", id, "data-points": points.length });
  root.append(svg("text", { x: W / 2, y: 14, "text-anchor": "middle", class: "plot-title" }, title));
  const xs = scaleOf(points.map((p) => p.x), { log, integer: integerX });
  const ys = numericScale(points.map((p) => p.y));
  const px = (v) => L + (W - L - R) * v;
  const py = (v) => H - B - (H - T - B) * v;
  root.append(svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, class: "plot-area" }));
  if (xs) {
    for (const t of xs.ticks) {
      const x = px(xs.at(t));
      root.append(svg("line", { x1: x, x2: x, y1: T, y2: H - B, class: "grid" }));
      root.append(svg("text", { x, y: H - B + 14, "text-anchor": "middle", class: "tick tick-x" }, xs.categorical ? shorten(t, 10) : fmtX(t)));
    }
  }
  if (ys) {
    for (const t of ys.ticks) {
      const y = py(ys.at(t));
      root.append(svg("line", { x1: L, x2: W - R, y1: y, y2: y, class: "grid" }));
      root.append(svg("text", { x: L - 5, y: y + 3.5, "text-anchor": "end", class: "tick tick-y" }, fmtY(t)));
    }
  }
  root.append(svg("text", { x: L + (W - L - R) / 2, y: H - 6, "text-anchor": "middle", class: "axis-label" }, xLabel || ""));
  if (!xs || !ys) return root;
  const rings = [];
  for (const p of points) {
    const [a, b] = [xs.at(p.x), ys.at(p.y)];
    if (a === null || b === null) continue;
    const dot = svg("circle", { cx: px(a), cy: py(b), r: 3.5, class: "dot" });
    dot.append(svg("title", {}, p.label));
    root.append(dot);
    if (p.best) {
      const ring = svg("circle", { cx: px(a), cy: py(b), r: 7.5, class: "best-ring" });
      ring.append(svg("title", {}, `best: ${p.label}`));
      rings.push(ring);
    }
  }
  root.append(...rings);
  return root;
}

// axes: [{key, label, title, values (one per line), log, integer, fmt}]; lines: [{label,
// title, color, width, className}]. A line skips an axis where it has no value.
export function parallelCoordinates({ id, axes, lines }) {
  // Its natural size (narrowed, never widened, by its box): the text stays readable.
  const W = Math.min(1320, Math.max(560, 160 * axes.length)), H = 300, T = 42, B = 26, side = 60;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "parallel", id, "data-lines": lines.length, "data-axes": axes.length });
  const gap = axes.length > 1 ? (W - 2 * side) / (axes.length - 1) : 0;
  const ax = (i) => side + gap * i;
  const py = (v) => H - B - (H - T - B) * v;
  const scales = axes.map((a) => scaleOf(a.values, { log: a.log, integer: a.integer, pad: 0.04 }));
  axes.forEach((a, i) => {
    const x = ax(i);
    const g = svg("g", { class: "pc-axis", "data-key": a.key });
    g.append(svg("line", { x1: x, x2: x, y1: T, y2: H - B }));
    const name = svg("text", { x, y: T - 22, "text-anchor": "middle", class: "axis-label" }, shorten(a.label, 22));
    name.append(svg("title", {}, a.title || a.key));
    g.append(name);
    const s = scales[i];
    if (s) {
      const ticks = s.categorical && s.ticks.length > 12 ? s.ticks.filter((_, k) => k % Math.ceil(s.ticks.length / 12) === 0) : s.ticks;
      for (const t of ticks) {
        const y = py(s.at(t));
        g.append(svg("line", { x1: x - 3, x2: x + 3, y1: y, y2: y }));
        g.append(svg("text", { x: x - 6, y: y + 3.5, "text-anchor": "end", class: "tick" }, s.categorical ? shorten(t, 12) : (a.fmt || sig)(t)));
      }
    }
    root.append(g);
  });
  lines.forEach((line, j) => {
    let d = "";
    let open = false;
    axes.forEach((a, i) => {
      const v = scales[i] ? scales[i].at(a.values[j]) : null;
      if (v === null) {
        open = false;
        return;
      }
      d += `${open ? "L" : "M"}${ax(i).toFixed(1)},${py(v).toFixed(1)}`;
      open = true;
    });
    const path = svg("path", { d, class: `pc-line ${line.className || ""}`.trim(), stroke: line.color, "stroke-width": line.width || 1.8, "data-line": j });
    path.append(svg("title", {}, line.title || line.label));
    root.append(path);
  });
  return root;
}
