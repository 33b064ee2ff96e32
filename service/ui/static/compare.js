// Several jobs side by side (#/compare?ids=a,b,c[&metrics=m1,m2]), from GET /v1/jobs/compare:
// one chart per metric with a line per job (labelled by the parameters that differ), the
// parameters table with the differing rows first, and a sortable results table.

import { api } from "./api.js";
import { h, badge, duration, isFraction, percent } from "./dom.js";
import { LineChart, formatNumber } from "./chart.js";

function shortKey(key) {
  return key.split(".").slice(-1)[0];
}

// A parameter as the spec holds it (0.1 stays 0.1).
function shown(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

// What tells the jobs apart in a legend: the differing parameters (datasets and other long
// values left out), else the job's name.
function legendOf(job, differing) {
  const parts = differing
    .filter((k) => k.startsWith("parameters.") || k.startsWith("model.") || k.startsWith("resources."))
    .map((k) => `${shortKey(k)}=${shown(job.parameters[k])}`);
  return parts.length ? `${job.name} (${parts.join(", ")})` : job.name;
}

function paramsTable(comparison) {
  const differing = new Set(comparison.differing);
  const keys = [...new Set(comparison.jobs.flatMap((j) => Object.keys(j.parameters)))].sort();
  keys.sort((a, b) => Number(differing.has(b)) - Number(differing.has(a)));
  return h(
    "table",
    { class: "table", id: "compare-params" },
    h("thead", {}, h("tr", {}, h("th", {}, "Parameter"), ...comparison.jobs.map((j) => h("th", {}, j.name)))),
    h(
      "tbody",
      {},
      ...keys.map((key) =>
        h(
          "tr",
          { class: differing.has(key) ? "differs" : "same", dataset: { key } },
          h("td", { class: "mono small" }, key),
          ...comparison.jobs.map((j) => h("td", {}, shown(j.parameters[key]))),
        ),
      ),
    ),
  );
}

function resultsTable(comparison) {
  const columns = [
    { title: "Job", value: (j) => j.name, cell: (j) => h("a", { href: `#/jobs/${encodeURIComponent(j.id)}` }, j.name) },
    { title: "Status", value: (j) => j.status, cell: (j) => badge(j.status) },
    { title: "Duration", value: (j) => j.duration_s, cell: (j) => duration(j.duration_s) },
    { title: "Images/s", value: (j) => j.images_per_sec, cell: (j) => formatNumber(j.images_per_sec) },
  ];
  for (const name of comparison.metrics) {
    const goal = comparison.goals[name] || "max";
    const best = (j) => j.metrics[name] && j.metrics[name].best;
    const final = (j) => j.metrics[name] && j.metrics[name].final;
    // Accuracies in %, as everywhere in the UI and the CLI.
    const fmt = isFraction(name) ? (v) => percent(v) : formatNumber;
    columns.push({
      title: `${name} best (${goal})`,
      metric: name,
      value: (j) => (best(j) ? best(j).value : null),
      cell: (j) => (best(j) ? `${fmt(best(j).value)} (epoch ${best(j).epoch})` : "–"),
    });
    columns.push({
      title: `${name} final`,
      value: (j) => (final(j) ? final(j).value : null),
      cell: (j) => (final(j) ? fmt(final(j).value) : "–"),
    });
  }
  const body = h("tbody", {});
  const rows = comparison.jobs.map((job) =>
    h("tr", { class: "compare-row", dataset: { jobId: job.id } }, ...columns.map((c) => h("td", {}, c.cell(job)))),
  );
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
  const headers = columns.map((c, i) =>
    h("th", { class: "sortable", title: "sort", dataset: { column: String(i) }, onclick: () => sortBy(i) }, c.title),
  );
  return h("table", { class: "table", id: "compare-results" }, h("thead", {}, h("tr", {}, ...headers)), body);
}

export async function renderCompare(ctx) {
  const ids = (ctx.params.get("ids") || "").split(",").filter(Boolean);
  const metrics = (ctx.params.get("metrics") || "").split(",").filter(Boolean);
  if (!ids.length) {
    ctx.main.replaceChildren(
      h("h1", {}, "Compare jobs"),
      h("p", { class: "hint", id: "compare-empty" }, "Select jobs in the jobs list, then Compare."),
    );
    return;
  }
  const q = new URLSearchParams({ ids: ids.join(","), points: "2000" });
  if (metrics.length) q.set("metrics", metrics.join(","));
  const comparison = await api(`/v1/jobs/compare?${q}`);
  const charts = h("div", { class: "charts", id: "compare-charts" });
  ctx.main.replaceChildren(
    h("div", { class: "page-head" }, h("h1", {}, `Compare ${comparison.jobs.length} jobs`)),
    charts,
    h("h2", {}, "Results"),
    resultsTable(comparison),
    h("h2", {}, "Parameters"),
    comparison.differing.length
      ? h("p", { class: "hint" }, `${comparison.differing.length} parameter(s) differ; they come first.`)
      : h("p", { class: "hint" }, "No parameter differs."),
    paramsTable(comparison),
  );
  const drawn = [];
  for (const name of comparison.metrics) {
    const box = h("div", { class: "chart-box", dataset: { metric: name } });
    charts.append(box);
    const chart = new LineChart(box, {
      title: name,
      percent: isFraction(name),
      log: /loss$/.test(name),
      series: comparison.jobs.map((j) => ({ name: j.id, label: legendOf(j, comparison.differing) })),
    });
    for (const job of comparison.jobs) {
      const s = job.metrics[name] && job.metrics[name].series;
      const line = chart.byName(job.id);
      if (s && line) {
        line.x = s.x;
        line.y = s.y;
      }
    }
    drawn.push(chart);
  }
  ctx.onLeave(() => drawn.forEach((c) => c.destroy()));
  // Every chart drawn once with all its lines: then the page is ready (its mark is what
  // bench/bench_ui.py reads).
  await Promise.all(drawn.map((c) => c.draw()));
  drawn.forEach((c) => {
    c.root.dataset.points = String(c.points());
  });
  performance.mark("torchyard:compare-ready");
  charts.dataset.ready = "true";
}
