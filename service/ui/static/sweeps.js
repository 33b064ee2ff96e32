// Sweeps: the list, and a sweep's page with its trials table (sortable, refreshed while
// the sweep runs) and a scatter chart of the objective against each parameter and
// against the trial number.

import { api } from "./api.js";
import { h, when, badge } from "./dom.js";
import { formatNumber } from "./chart.js";

const REFRESH_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function shown(v) {
  return typeof v === "number" ? formatNumber(v) : String(v);
}

export async function renderSweeps(ctx) {
  const page = await api("/v1/sweeps");
  const items = page.items || [];
  const rows = items.map((s) =>
    h(
      "tr",
      { dataset: { id: s.id } },
      h("td", {}, h("a", { href: `#/sweeps/${s.id}` }, s.name)),
      h("td", {}, badge(s.status)),
      h("td", {}, s.algorithm + (s.early_stopping ? ` + ${s.early_stopping.type}` : "")),
      h("td", {}, String(Object.values(s.trial_counts || {}).reduce((a, b) => a + b, 0)) + ` / ${s.max_trials}`),
      h("td", {}, s.best_trial ? shown(s.best_trial.value) : "–"),
      h("td", {}, when(s.created_at)),
    ),
  );
  ctx.main.replaceChildren(
    h("h1", {}, "Sweeps"),
    items.length
      ? h(
          "table",
          { class: "table", id: "sweeps-table" },
          h("thead", {}, h("tr", {}, ...["Name", "Status", "Algorithm", "Trials", "Best", "Created"].map((t) => h("th", {}, t)))),
          h("tbody", {}, ...rows),
        )
      : h("p", { class: "hint", id: "sweeps-empty" }, "No sweeps yet: start one with torchyard sweep submit FILE (see docs/sweeps.md)."),
  );
}

// A scatter of (x, objective) points; categorical x values are spread evenly.
function scatter(id, title, points, { log = false } = {}) {
  const W = 320, H = 200, P = 34;
  const root = svg("svg", { width: W, height: H, class: "scatter", id, "data-points": String(points.length) });
  const numeric = points.every((p) => typeof p.x === "number");
  const cats = numeric ? [] : [...new Set(points.map((p) => String(p.x)))];
  const xs = points.map((p) => (numeric ? (log ? Math.log10(p.x) : p.x) : cats.indexOf(String(p.x))));
  const ys = points.map((p) => p.y);
  const [x0, x1] = [Math.min(...xs, 0), Math.max(...xs, 1)].map(Number);
  const xmin = numeric ? Math.min(...xs) : -0.5, xmax = numeric ? Math.max(...xs) : cats.length - 0.5;
  const ymin = Math.min(...ys), ymax = Math.max(...ys);
  const sx = (v) => P + ((v - xmin) / (xmax - xmin || 1)) * (W - 2 * P);
  const sy = (v) => H - P - ((v - ymin) / (ymax - ymin || 1)) * (H - 2 * P);
  root.append(svg("line", { x1: P, y1: H - P, x2: W - P, y2: H - P, stroke: "#94a3b8" }));
  root.append(svg("line", { x1: P, y1: P, x2: P, y2: H - P, stroke: "#94a3b8" }));
  const label = svg("text", { x: W / 2, y: 14, "text-anchor": "middle", "font-size": "12" });
  label.textContent = title;
  root.append(label);
  for (const [text, x, y, anchor] of [
    [shown(ymax), P - 4, P + 4, "end"],
    [shown(ymin), P - 4, H - P, "end"],
    [numeric ? shown(log ? 10 ** xmin : xmin) : cats[0] || "", P, H - P + 14, "start"],
    [numeric ? shown(log ? 10 ** xmax : xmax) : cats[cats.length - 1] || "", W - P, H - P + 14, "end"],
  ]) {
    const t = svg("text", { x, y, "text-anchor": anchor, "font-size": "10" });
    t.textContent = text;
    root.append(t);
  }
  points.forEach((p, i) => {
    const c = svg("circle", { cx: sx(xs[i]), cy: sy(ys[i]), r: 4, fill: p.best ? "#dc2626" : "#2563eb", opacity: "0.8" });
    const tip = svg("title");
    tip.textContent = `trial ${p.n}: ${shown(p.x)} → ${shown(p.y)}`;
    c.append(tip);
    root.append(c);
  });
  void x0, void x1;
  return h("div", { class: "scatter-box" }, root);
}

function trialsTable(sweep, sort) {
  const keys = Object.keys(sweep.search_space || {});
  const columns = [
    ["#", (t) => t.number],
    ["State", (t) => t.state],
    ["Value", (t) => t.value],
    ["Epochs", (t) => t.epochs],
    ...keys.map((k) => [k.split(".").pop(), (t) => t.params[k]]),
    ["Job", (t) => t.job_id],
    ["Reason", (t) => t.reason || ""],
  ];
  const trials = [...(sweep.trials || [])];
  const [col, dir] = [sort.col, sort.dir];
  const get = columns[col][1];
  trials.sort((a, b) => {
    const va = get(a), vb = get(b);
    if (va === null || va === undefined) return 1;
    if (vb === null || vb === undefined) return -1;
    return (va < vb ? -1 : va > vb ? 1 : 0) * dir;
  });
  const head = columns.map(([name], i) =>
    h("th", { class: "sortable", dataset: { col: String(i) }, onclick: () => sort.set(i) }, name + (i === col ? (dir > 0 ? " ▲" : " ▼") : "")),
  );
  const rows = trials.map((t) =>
    h(
      "tr",
      { dataset: { number: String(t.number), state: t.state } },
      ...columns.map(([name, f]) => {
        const v = f(t);
        if (name === "Job") return h("td", {}, h("a", { href: `#/jobs/${v}` }, v.slice(0, 12)));
        if (name === "State") return h("td", {}, badge(v));
        return h("td", {}, v === null || v === undefined ? "–" : shown(v));
      }),
    ),
  );
  return h("table", { class: "table", id: "trials-table" }, h("thead", {}, h("tr", {}, ...head)), h("tbody", {}, ...rows));
}

export async function renderSweep(ctx, id) {
  const sort = { col: 0, dir: 1, set: null };
  let sweep = null;
  const draw = () => {
    const best = sweep.best_trial;
    const scored = (sweep.trials || []).filter((t) => t.value !== null && t.value !== undefined);
    const charts = [];
    const pts = (f) => scored.map((t) => ({ x: f(t), y: t.value, n: t.number, best: best && best.number === t.number }));
    charts.push(scatter("chart-trial-number", `${sweep.objective.metric} by trial`, pts((t) => t.number)));
    for (const [key, range] of Object.entries(sweep.search_space || {})) {
      charts.push(scatter(`chart-${key.replace(/[^A-Za-z0-9]/g, "-")}`, `${sweep.objective.metric} by ${key}`, pts((t) => t.params[key]), { log: !!range.log }));
    }
    const cancel = h("button", { id: "cancel-sweep", onclick: async () => { sweep = await api(`/v1/sweeps/${sweep.id}/cancel`, { method: "POST" }); draw(); } }, "Cancel sweep");
    ctx.main.replaceChildren(
      h("h1", {}, `Sweep ${sweep.name} `, badge(sweep.status)),
      h(
        "p",
        { id: "sweep-summary" },
        `${sweep.algorithm}${sweep.early_stopping ? " + " + sweep.early_stopping.type : ""}, ${sweep.objective.goal} ${sweep.objective.metric}; `,
        `${(sweep.trials || []).length} of ${sweep.max_trials} trials, ${sweep.epochs_run} epochs run`,
        sweep.message ? ` — ${sweep.message}` : "",
      ),
      best ? h("p", { id: "sweep-best" }, `Best: trial ${best.number}, ${shown(best.value)} (`, h("a", { href: `#/jobs/${best.job_id}` }, "job"), ")") : h("p", { class: "hint" }, "No completed trial yet."),
      sweep.status === "running" ? cancel : "",
      h("div", { class: "scatter-row", id: "sweep-charts" }, ...charts),
      trialsTable(sweep, sort),
    );
  };
  sort.set = (i) => {
    sort.dir = sort.col === i ? -sort.dir : 1;
    sort.col = i;
    draw();
  };
  sweep = await api(`/v1/sweeps/${encodeURIComponent(id)}`);
  draw();
  const timer = setInterval(async () => {
    if (sweep.status !== "running") return;
    try {
      sweep = await api(`/v1/sweeps/${encodeURIComponent(id)}`);
      draw();
    } catch {
      // the next refresh tries again
    }
  }, REFRESH_MS);
  ctx.onLeave(() => clearInterval(timer));
}
