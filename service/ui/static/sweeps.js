// Sweeps: the list, and a sweep's page: its trials table (sortable, refreshed while the
// sweep runs), a scatter of the objective against the trial number and against each
// parameter (the best trial ringed), each parameter's importance (Optuna's, from GET
// /v1/sweeps/{id}/importance) and parallel coordinates of every scored trial. An accuracy
// objective is shown in %, as everywhere in the UI.

import { api } from "./api.js";
import { h, fill, when, badge, isFraction, sig, fieldLabel } from "./dom.js";
import { formatPercent } from "./chart.js";
import { scatter, parallelCoordinates } from "./svgplot.js";

const REFRESH_MS = 2000;

// The objective's values as the UI shows them: % for accuracies, else 4 significant digits.
function objectiveFormat(metric) {
  return isFraction(metric) ? (v) => (typeof v === "number" ? `${(v * 100).toFixed(1)}%` : "–") : (v) => sig(v);
}

function shown(v) {
  return v === null || v === undefined ? "–" : sig(v);
}

export async function renderSweeps(ctx) {
  const page = await api("/v1/sweeps");
  const items = page.items || [];
  const rows = items.map((s) => {
    const fmt = objectiveFormat(s.objective.metric);
    return h(
      "tr",
      { dataset: { id: s.id } },
      h("td", {}, h("a", { href: `#/sweeps/${s.id}` }, s.name)),
      h("td", {}, badge(s.status)),
      h("td", {}, s.algorithm + (s.early_stopping ? ` + ${s.early_stopping.type}` : "")),
      h("td", {}, String(Object.values(s.trial_counts || {}).reduce((a, b) => a + b, 0)) + ` / ${s.max_trials}`),
      h("td", { class: "num" }, s.best_trial ? fmt(s.best_trial.value) : "–"),
      h("td", {}, when(s.created_at)),
    );
  });
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

function trialsTable(sweep, sort, fmt) {
  const keys = Object.keys(sweep.search_space || {});
  const columns = [
    ["#", (t) => t.number],
    ["State", (t) => t.state],
    ["Value", (t) => t.value],
    ["Epochs", (t) => t.epochs],
    ...keys.map((k) => [k.split(".").pop(), (t) => t.params[k], k]),
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
  const head = columns.map(([name, , key], i) =>
    h("th", { class: "sortable", title: key, dataset: { col: String(i) }, onclick: () => sort.set(i) }, name + (i === col ? (dir > 0 ? " ▲" : " ▼") : "")),
  );
  const rows = trials.map((t) =>
    h(
      "tr",
      { dataset: { number: String(t.number), state: t.state } },
      ...columns.map(([name, f]) => {
        const v = f(t);
        if (name === "Job") return h("td", {}, h("a", { href: `#/jobs/${v}` }, v.slice(0, 12)));
        if (name === "State") return h("td", {}, badge(v));
        if (name === "Value") return h("td", { class: "num", title: v === null || v === undefined ? undefined : String(v) }, v === null || v === undefined ? "–" : fmt(v));
        return h("td", { title: typeof v === "number" && String(v) !== shown(v) ? String(v) : undefined }, shown(v));
      }),
    ),
  );
  return h("table", { class: "table", id: "trials-table" }, h("thead", {}, h("tr", {}, ...head)), h("tbody", {}, ...rows));
}

// Each search-space key's importance for the objective, as bars (largest first).
function importanceBlock(found) {
  const box = h("section", { class: "card", id: "sweep-importance" }, h("h2", {}, "Parameter importance"));
  if (!found) return fill(box, box.firstChild, h("p", { class: "hint" }, "loading…"));
  if (!found.importances) {
    box.append(h("p", { class: "hint", id: "importance-note" }, found.message || "Not enough completed trials yet."));
    return box;
  }
  const rows = Object.entries(found.importances).map(([key, share]) => {
    const bar = h("span", { class: "bar" });
    bar.style.width = `${Math.max(1, Math.round(share * 100))}%`;
    return h(
      "div",
      { class: "importance-row", dataset: { key, share: String(share) } },
      h("span", { class: "importance-key", title: key }, fieldLabel(key)),
      h("span", { class: "importance-bar" }, bar),
      h("span", { class: "num" }, `${(share * 100).toFixed(0)}%`),
    );
  });
  box.append(
    ...rows,
    h("p", { class: "hint" }, `How much each parameter mattered to ${found.objective.metric} over ${found.completed} completed trials (Optuna's PED-ANOVA importance; the shares add up to 100%).`),
  );
  return box;
}

// One line per scored trial across its parameters and the objective, coloured by the
// objective (the best trial on top, thicker).
function parallelBlock(sweep, scored, fmt) {
  const keys = Object.keys(sweep.search_space || {});
  if (scored.length < 2) return null;
  const goalMax = sweep.objective.goal !== "minimize";
  const order = [...scored].sort((a, b) => (goalMax ? a.value - b.value : b.value - a.value)); // best last: drawn on top
  const values = order.map((t) => t.value);
  const lo = Math.min(...values), hi = Math.max(...values);
  const best = sweep.best_trial && sweep.best_trial.number;
  const colour = (v) => {
    const share = hi > lo ? (v - lo) / (hi - lo) : 1;
    const good = goalMax ? share : 1 - share;
    return `hsl(218, 75%, ${Math.round(82 - 50 * good)}%)`;
  };
  const axes = keys.map((key) => {
    const range = sweep.search_space[key] || {};
    const vals = order.map((t) => (t.params[key] === undefined ? null : t.params[key]));
    const numeric = range.type !== "categorical" && vals.every((v) => v === null || typeof v === "number");
    return { key, label: fieldLabel(key), title: key, values: numeric ? vals : vals.map((v) => (v === null ? null : String(v))), log: !!range.log, integer: range.type === "int" };
  });
  axes.push({ key: "objective", label: sweep.objective.metric, title: `${sweep.objective.metric} (${sweep.objective.goal})`, values, fmt: isFraction(sweep.objective.metric) ? formatPercent : sig });
  const lines = order.map((t) => ({
    label: `trial ${t.number}`,
    title: [`trial ${t.number}: ${fmt(t.value)}`, ...keys.map((k) => `${k.split(".").pop()} = ${shown(t.params[k])}`)].join("\n"),
    color: t.number === best ? "#dc2626" : colour(t.value),
    width: t.number === best ? 3.5 : 1.8,
    className: t.number === best ? "best" : "",
  }));
  return h(
    "section",
    { class: "card", id: "sweep-parallel" },
    h("h2", {}, "Parallel coordinates"),
    h("p", { class: "hint" }, "One line per scored trial across its parameters and its value: the darker, the better; the best trial in red. Hover a line for its trial."),
    h("div", { class: "parallel-box" }, parallelCoordinates({ id: "sweep-parallel-chart", axes, lines })),
  );
}

export async function renderSweep(ctx, id) {
  const sort = { col: 0, dir: 1, set: null };
  let sweep = null;
  let importance = null;
  let importanceFor = -1; // completed trials the importances were asked for
  const draw = () => {
    const best = sweep.best_trial;
    const metric = sweep.objective.metric;
    const fmt = objectiveFormat(metric);
    const fmtY = isFraction(metric) ? formatPercent : sig;
    const scored = (sweep.trials || []).filter((t) => t.value !== null && t.value !== undefined);
    const pts = (f) => scored.map((t) => ({ x: f(t), y: t.value, best: !!best && best.number === t.number, label: `trial ${t.number}: ${shown(f(t))} → ${fmt(t.value)}` }));
    const charts = [scatter({ id: "chart-trial-number", title: `${metric} by trial`, xLabel: "trial", points: pts((t) => t.number), integerX: true, fmtY })];
    for (const [key, range] of Object.entries(sweep.search_space || {})) {
      charts.push(
        scatter({
          id: `chart-${key.replace(/[^A-Za-z0-9]/g, "-")}`,
          title: `${metric} by ${key.split(".").pop()}`,
          xLabel: key,
          points: pts((t) => t.params[key]),
          log: !!range.log,
          integerX: range.type === "int",
          fmtY,
        }),
      );
    }
    const cancel = h("button", { id: "cancel-sweep", onclick: async () => { sweep = await api(`/v1/sweeps/${sweep.id}/cancel`, { method: "POST" }); draw(); } }, "Cancel sweep");
    fill(
      ctx.main,
      h("h1", {}, `Sweep ${sweep.name} `, badge(sweep.status)),
      h(
        "p",
        { id: "sweep-summary" },
        `${sweep.algorithm}${sweep.early_stopping ? " + " + sweep.early_stopping.type : ""}, ${sweep.objective.goal} ${metric}; `,
        `${(sweep.trials || []).length} of ${sweep.max_trials} trials, ${sweep.epochs_run} epochs run`,
        sweep.message ? ` — ${sweep.message}` : "",
      ),
      best ? h("p", { id: "sweep-best" }, `Best: trial ${best.number}, ${metric} ${fmt(best.value)} (`, h("a", { href: `#/jobs/${best.job_id}` }, "job"), ")") : h("p", { class: "hint" }, "No completed trial yet."),
      sweep.status === "running" ? cancel : null,
      h("div", { class: "scatter-row", id: "sweep-charts" }, ...charts.map((c) => h("div", { class: "scatter-box" }, c))),
      h("div", { class: "sweep-analysis" }, importanceBlock(importance), parallelBlock(sweep, scored, fmt)),
      h("div", { class: "table-scroll" }, trialsTable(sweep, sort, fmt)),
    );
    // The importances change only when a trial completes: asked for then.
    const completed = (sweep.trials || []).filter((t) => t.state === "completed" && t.value !== null).length;
    if (completed !== importanceFor) {
      importanceFor = completed;
      api(`/v1/sweeps/${encodeURIComponent(sweep.id)}/importance`)
        .then((found) => {
          if (importanceFor !== completed) return;
          importance = found;
          ctx.main.querySelector("#sweep-importance")?.replaceWith(importanceBlock(importance));
        })
        .catch((err) => {
          importance = { message: `importance not available: ${err.message}` };
          ctx.main.querySelector("#sweep-importance")?.replaceWith(importanceBlock(importance));
        });
    }
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
