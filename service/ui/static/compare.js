// Several jobs side by side (#/compare?ids=a,b,c[&metrics=m1,m2][&x=epoch|step]), from GET
// /v1/jobs/compare: one chart per metric with a line per job (named by the job; its
// differing parameters on hovering its legend entry), on an epoch axis where the jobs have
// epochs (jobs with other batch sizes line up) or a step axis; a sortable results table
// (each best value with its epoch, or its step for a job without epochs); parallel
// coordinates of the differing parameters and each metric's best value; and the parameters
// table with the differing rows first: the spec's, then what the jobs' MLflow runs logged
// (rows "mlflow: lr", "mlflow tag: team"; "mlflow: <run>: lr" for a job of several runs).

import { api } from "./api.js";
import { h, fill, badge, duration, isFraction, percent, sig } from "./dom.js";
import { LineChart, PALETTE, formatNumber, formatPercent } from "./chart.js";
import { parallelCoordinates } from "./svgplot.js";

const MAX_PARALLEL_AXES = 12;

// A parameter's key as the legend and the charts say it (parameters.learning_rate is
// learning_rate; model.architecture stays).
function shortKey(key) {
  return key.startsWith("parameters.") ? key.slice("parameters.".length) : key;
}

// A parameter as a person reads it: numbers to 4 significant digits.
function shown(value) {
  if (value === null || value === undefined) return "–";
  return sig(value);
}

// Each job's name in legends and headers; a name two jobs share gets the start of the id.
function shortNames(jobs) {
  const count = new Map();
  for (const j of jobs) count.set(j.name, (count.get(j.name) || 0) + 1);
  return new Map(jobs.map((j) => [j.id, count.get(j.name) > 1 ? `${j.name} · ${j.id.slice(0, 6)}` : j.name]));
}

// The rows of the parameters table: the spec's keys, then the logged ones (an older
// service sends none); a row's value for a job.
function loggedKeys(comparison) {
  return [...new Set(comparison.jobs.flatMap((j) => Object.keys(j.logged || {})))];
}

function valueOf(job, key) {
  const logged = job.logged || {};
  return Object.prototype.hasOwnProperty.call(logged, key) ? logged[key] : job.parameters[key];
}

// Every key that differs: the spec's, then the logged ones.
function differingKeys(comparison) {
  return [...comparison.differing, ...(comparison.logged_differing || [])];
}

// What tells a job apart, for a tooltip: its differing parameters, one a line.
function paramsTitle(job, differing, name) {
  const lines = differing.map((k) => `${shortKey(k)} = ${shown(valueOf(job, k))}`);
  return [`${name} (${job.type || "train"}, ${job.status})`, ...lines].join("\n");
}

// Where a job's best value was: its epoch, or its step for a job without epochs.
function whereText(job, point) {
  const axis = job.axis === "step" ? "step" : "epoch";
  return `${axis} ${point[axis]}`;
}

// Steps per epoch of a job: from its progress (total steps / epochs), else from its points
// (a validation metric is reported at an epoch's last step: the largest step / epoch).
// Null for a job without epochs (a script that reports steps only).
function stepsPerEpoch(job, detail) {
  if (job.axis === "step") return null;
  const p = detail && detail.progress;
  if (p && p.total_steps > 0 && p.epochs > 0) return p.total_steps / p.epochs;
  let most = 0;
  for (const m of Object.values(job.metrics || {})) {
    for (const pt of [m.best, m.final]) if (pt && pt.epoch > 0 && pt.step > 0) most = Math.max(most, pt.step / pt.epoch);
  }
  return most || null;
}

function swatch(color) {
  const el = h("span", { class: "swatch" });
  el.style.backgroundColor = color;
  return el;
}

function paramsTable(comparison, names, colors) {
  const differing = new Set(differingKeys(comparison));
  const logged = new Set(loggedKeys(comparison));
  const spec = [...new Set(comparison.jobs.flatMap((j) => Object.keys(j.parameters)))].sort();
  const tags = (k) => Number(k.startsWith("mlflow tag: "));
  // The spec's keys, then the logged params and tags; the differing rows first.
  const keys = [...spec, ...[...logged].sort().sort((a, b) => tags(a) - tags(b))];
  keys.sort((a, b) => Number(differing.has(b)) - Number(differing.has(a)));
  const cell = (value) => {
    const text = shown(value);
    const full = value !== null && typeof value === "object" ? JSON.stringify(value) : String(value);
    return h("td", { title: full !== text ? full : undefined }, text);
  };
  return h(
    "table",
    { class: "table", id: "compare-params" },
    h("thead", {}, h("tr", {}, h("th", {}, "Parameter"), ...comparison.jobs.map((j) => h("th", {}, swatch(colors.get(j.id)), names.get(j.id))))),
    h(
      "tbody",
      {},
      ...keys.map((key) =>
        h(
          "tr",
          { class: differing.has(key) ? "differs" : "same", dataset: logged.has(key) ? { key, logged: "true" } : { key } },
          h("td", { class: "mono small" }, key),
          ...comparison.jobs.map((j) => cell(valueOf(j, key))),
        ),
      ),
    ),
  );
}

function resultsTable(comparison, names, colors) {
  const columns = [
    { title: "Job", value: (j) => names.get(j.id), cell: (j) => [swatch(colors.get(j.id)), h("a", { href: `#/jobs/${encodeURIComponent(j.id)}` }, names.get(j.id))] },
    { title: "Status", value: (j) => j.status, cell: (j) => badge(j.status) },
    { title: "Duration", value: (j) => j.duration_s, cell: (j) => duration(j.duration_s) },
    { title: "Images/s", value: (j) => j.images_per_sec, cell: (j) => formatNumber(j.images_per_sec) },
  ];
  for (const name of comparison.metrics) {
    const goal = comparison.goals[name] || "max";
    const best = (j) => j.metrics[name] && j.metrics[name].best;
    const final = (j) => j.metrics[name] && j.metrics[name].final;
    // Accuracies in %, as everywhere in the UI and the CLI.
    const fmt = isFraction(name) ? (v) => percent(v) : (v) => sig(v);
    columns.push({
      title: `${name} best (${goal})`,
      metric: name,
      value: (j) => (best(j) ? best(j).value : null),
      cell: (j) => (best(j) ? `${fmt(best(j).value)} (${whereText(j, best(j))})` : "–"),
    });
    columns.push({
      title: `${name} final`,
      value: (j) => (final(j) ? final(j).value : null),
      cell: (j) => (final(j) ? fmt(final(j).value) : "–"),
    });
  }
  const body = h("tbody", {});
  const rows = comparison.jobs.map((job) => h("tr", { class: "compare-row", dataset: { jobId: job.id } }, ...columns.map((c) => h("td", {}, c.cell(job)))));
  body.append(...rows);
  let sorted = { index: -1, descending: false };
  const sortBy = (index) => {
    const descending = sorted.index === index ? !sorted.descending : false;
    sorted = { index, descending };
    const key = (job) => columns[index].value(job);
    const order = comparison.jobs
      .map((job, i) => ({ job, row: rows[i] }))
      .sort((a, b) => {
        const x = key(a.job);
        const y = key(b.job);
        if (x === null || x === undefined) return 1;
        if (y === null || y === undefined) return -1;
        const c = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
        return descending ? -c : c;
      });
    body.replaceChildren(...order.map((o) => o.row));
    headers.forEach((th, i) => {
      th.dataset.sorted = i === index ? (descending ? "desc" : "asc") : "";
    });
  };
  const headers = columns.map((c, i) => h("th", { class: "sortable", title: "sort", dataset: { column: String(i) }, onclick: () => sortBy(i) }, c.title));
  return h("table", { class: "table", id: "compare-results" }, h("thead", {}, h("tr", {}, ...headers)), body);
}

// A value fit for an axis of parallel coordinates: a number (an MLflow param is text: "0.1"
// is a number), a boolean (as text) or a short text.
function axisValue(v) {
  if (typeof v === "number" && Number.isFinite(v)) return v;
  if (typeof v === "string" && /^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$/.test(v)) return Number(v);
  if (typeof v === "boolean") return String(v);
  if (typeof v === "string" && v.length <= 24) return v;
  return null;
}

// The differing parameters (those with values an axis can show) and each metric's best value.
function parallelBlock(comparison, names, colors) {
  const jobs = comparison.jobs;
  const axes = [];
  for (const key of differingKeys(comparison)) {
    const raw = jobs.map((j) => valueOf(j, key));
    const values = raw.map(axisValue);
    // Worth an axis: two values at least (a key only some jobs have, the same in all of
    // them, says nothing a line could show).
    if (new Set(values.filter((v) => v !== null).map(String)).size < 2) continue;
    const numeric = values.every((v) => v === null || typeof v === "number");
    const positive = numeric && values.every((v) => v === null || v > 0);
    const nums = values.filter((v) => typeof v === "number");
    const log = positive && nums.length > 1 && Math.max(...nums) / Math.min(...nums) >= 100;
    axes.push({ key, label: shortKey(key), title: key, values: numeric ? values : values.map((v) => (v === null ? null : String(v))), log, integer: numeric && nums.every(Number.isInteger) });
  }
  const params = axes.slice(0, MAX_PARALLEL_AXES - Math.min(comparison.metrics.length, 4));
  const metrics = [];
  for (const name of comparison.metrics) {
    if (params.length + metrics.length >= MAX_PARALLEL_AXES) break;
    const values = jobs.map((j) => (j.metrics[name] && j.metrics[name].best ? j.metrics[name].best.value : null));
    if (values.filter((v) => v !== null).length < 2) continue;
    metrics.push({ key: name, label: `${name} best`, title: `${name}: the best value (${comparison.goals[name] || "max"})`, values, fmt: isFraction(name) ? formatPercent : sig });
  }
  const all = [...params, ...metrics];
  if (jobs.length < 2 || all.length < 2) return null;
  const lines = jobs.map((j) => ({ label: names.get(j.id), title: paramsTitle(j, differingKeys(comparison), names.get(j.id)), color: colors.get(j.id) }));
  return h(
    "section",
    { class: "card", id: "compare-parallel" },
    h("h2", {}, "Parallel coordinates"),
    h("p", { class: "hint" }, "One line per job across the parameters that differ and each metric's best value; hover a line for its job."),
    h("div", { class: "parallel-box" }, parallelCoordinates({ id: "compare-parallel-chart", axes: all, lines })),
  );
}

export async function renderCompare(ctx) {
  const ids = (ctx.params.get("ids") || "").split(",").filter(Boolean);
  const metrics = (ctx.params.get("metrics") || "").split(",").filter(Boolean);
  if (!ids.length) {
    ctx.main.replaceChildren(h("h1", {}, "Compare jobs"), h("p", { class: "hint", id: "compare-empty" }, "Select jobs in the jobs list, then Compare."));
    return;
  }
  const q = new URLSearchParams({ ids: ids.join(","), points: "2000" });
  if (metrics.length) q.set("metrics", metrics.join(","));
  // Each job's progress (its steps per epoch) is asked for beside the comparison.
  const details = Promise.all(ids.map((id) => api(`/v1/jobs/${encodeURIComponent(id)}`).catch(() => null)));
  const comparison = await api(`/v1/jobs/compare?${q}`);
  const byId = new Map((await details).filter(Boolean).map((j) => [j.id, j]));
  const jobs = comparison.jobs;
  const names = shortNames(jobs);
  const colors = new Map(jobs.map((j, i) => [j.id, PALETTE[i % PALETTE.length]]));
  const perEpoch = new Map(jobs.map((j) => [j.id, stepsPerEpoch(j, byId.get(j.id))]));
  const withEpochs = jobs.filter((j) => perEpoch.get(j.id));
  const asked = ctx.params.get("x");
  // Epochs when every job with points has them (a job without points draws no line anyway).
  const charted = jobs.filter((j) => Object.values(j.metrics || {}).some((m) => m.series && m.series.x.length));
  const allEpochs = charted.every((j) => perEpoch.get(j.id));
  let axis = asked === "epoch" || asked === "step" ? asked : allEpochs ? "epoch" : "step";
  if (!withEpochs.length) axis = "step";

  const charts = h("div", { class: "charts", id: "compare-charts" });
  const xSelect = h(
    "select",
    { id: "compare-x", title: "Epochs line up jobs with different batch sizes; steps are what each job counted" },
    h("option", { value: "epoch", selected: axis === "epoch", disabled: !withEpochs.length }, "epoch"),
    h("option", { value: "step", selected: axis === "step" }, "step"),
  );
  const xNote = h("span", { id: "compare-x-note", class: "hint" });
  const parallel = parallelBlock(comparison, names, colors);
  fill(
    ctx.main,
    h("div", { class: "page-head" }, h("h1", {}, `Compare ${jobs.length} jobs`), h("label", { for: "compare-x", class: "inline" }, "x axis "), xSelect, xNote),
    charts,
    h("h2", {}, "Results"),
    h("div", { class: "table-scroll" }, resultsTable(comparison, names, colors)),
    parallel,
    h("h2", {}, "Parameters"),
    differingKeys(comparison).length
      ? h("p", { class: "hint" }, `${differingKeys(comparison).length} parameter(s) differ; they come first.`)
      : h("p", { class: "hint" }, "No parameter differs."),
    h("div", { class: "table-scroll" }, paramsTable(comparison, names, colors)),
  );

  let drawn = [];
  ctx.onLeave(() => drawn.forEach((c) => c.destroy()));
  const draw = async () => {
    drawn.forEach((c) => c.destroy());
    drawn = [];
    charts.replaceChildren();
    charts.dataset.ready = "false";
    charts.dataset.axis = axis;
    const shownJobs = axis === "epoch" ? withEpochs : jobs;
    const left = jobs.filter((j) => !shownJobs.includes(j)).map((j) => names.get(j.id));
    xNote.textContent = left.length ? `without epochs, shown on the step axis only: ${left.join(", ")}` : "";
    for (const name of comparison.metrics) {
      const box = h("div", { class: "chart-box", dataset: { metric: name } });
      charts.append(box);
      const chart = new LineChart(box, {
        title: name,
        percent: isFraction(name),
        log: /loss$/.test(name),
        xLabel: axis,
        integerX: axis === "step",
        series: shownJobs.map((j) => ({ name: j.id, label: names.get(j.id), title: paramsTitle(j, differingKeys(comparison), names.get(j.id)), color: colors.get(j.id) })),
      });
      for (const job of shownJobs) {
        const s = job.metrics[name] && job.metrics[name].series;
        const line = chart.byName(job.id);
        if (s && line) {
          const per = perEpoch.get(job.id);
          line.x = axis === "epoch" ? s.x.map((v) => v / per) : s.x;
          line.y = s.y;
        }
      }
      drawn.push(chart);
    }
    // Every chart drawn once with all its lines: then the page is ready (its mark is what
    // bench/bench_ui.py reads).
    await Promise.all(drawn.map((c) => c.draw()));
    drawn.forEach((c) => {
      c.root.dataset.points = String(c.points());
    });
    charts.dataset.ready = "true";
  };
  xSelect.addEventListener("change", () => {
    axis = xSelect.value;
    // The link says the axis chosen, without drawing the page again.
    const params = new URLSearchParams(ctx.params);
    params.set("x", axis);
    history.replaceState(null, "", `#/compare?${params.toString().replace(/%2C/g, ",")}`);
    draw();
  });
  await draw();
  performance.mark("torchyard:compare-ready");
}
