// The jobs list: filter by status, live status changes from GET /v1/jobs/events, each job's
// type, a detail fitting its type, its best top-1, age and duration.

import { api } from "./api.js";
import { h, badge, duration, secondsSince, percent, FINAL } from "./dom.js";

const STATUSES = ["queued", "scheduled", "running", "cancelling", "succeeded", "failed", "cancelled"];

function progressText(job) {
  const p = job.progress;
  if (!p || !p.epochs) return "";
  return `epoch ${p.epoch}/${p.epochs}`;
}

const TYPES = { train: "train", script: "script", evaluate: "evaluation" };

// What a row says beside the status: why it waits, else by type: a training job's epoch, an
// evaluation's model (and top-1 once done), a script's command (or its epoch if it reports one).
function detailText(job) {
  if (job.reason) return job.reason;
  const type = job.type || "train";
  if (type === "evaluate") {
    const top1 = (job.best || {})["val.top1"];
    const model = job.model ? `model ${job.model}` : "evaluation";
    return typeof top1 === "number" ? `${model}: top-1 ${percent(top1)}` : model;
  }
  if (type === "script") {
    const command = (job.command || []).join(" ");
    const short = command.length > 60 ? `${command.slice(0, 57)}…` : command;
    return progressText(job) || (short ? `$ ${short}` : "");
  }
  return progressText(job);
}

// A bar of the job's fraction done and its time left (progress.eta_s: the API's estimate
// from the recent steps); empty before any progress.
function progressCell(job) {
  const p = job.progress || {};
  const cell = h("td", { class: "progress" });
  if (typeof p.fraction !== "number") return cell;
  const left = typeof p.eta_s === "number" && !FINAL.has(job.status) ? ` ${duration(p.eta_s)} left` : "";
  cell.append(
    h(
      "span",
      { class: "job-progress", title: `${Math.round(p.fraction * 100)}% of the steps` },
      h("progress", { max: "1", value: String(p.fraction) }),
      h("span", { class: "small eta" }, `${Math.round(p.fraction * 100)}%${left}`),
    ),
  );
  return cell;
}

function bestTop1(job) {
  const top1 = (job.best || {})["val.top1"];
  return typeof top1 === "number" ? percent(top1) : "";
}

function row(job, selected, onSelect) {
  const age = h("td", { class: "age" });
  const took = h("td", { class: "duration" });
  const tick = () => {
    age.textContent = duration(secondsSince(job.created_at));
    took.textContent = job.started_at ? duration(secondsSince(job.started_at, job.finished_at)) : "";
  };
  tick();
  const tr = h(
    "tr",
    { class: "job-row", dataset: { jobId: job.id, status: job.status } },
    h(
      "td",
      {},
      h("input", {
        type: "checkbox",
        class: "select-job",
        "aria-label": `select ${job.name}`,
        checked: selected.has(job.id),
        onchange: (e) => onSelect(job.id, e.target.checked),
      }),
    ),
    h("td", {}, h("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, class: "job-link" }, job.name)),
    h("td", { class: "type" }, TYPES[job.type || "train"] || job.type),
    h("td", { class: "status" }, badge(job.status)),
    progressCell(job),
    h("td", { class: "reason" }, detailText(job)),
    h("td", { class: "best num" }, bestTop1(job)),
    age,
    took,
    h("td", { class: "mono small" }, job.id.slice(0, 8)),
  );
  tr.tick = tick;
  tr.job = job;
  return tr;
}

export async function renderJobs(ctx) {
  const wanted = ctx.params.getAll("status").filter((s) => STATUSES.includes(s));
  const select = h(
    "select",
    {
      id: "status-filter",
      onchange: () => {
        location.hash = select.value ? `#/jobs?status=${select.value}` : "#/jobs";
      },
    },
    h("option", { value: "" }, "all statuses"),
    ...STATUSES.map((s) => h("option", { value: s, selected: wanted.length === 1 && wanted[0] === s }, s)),
  );
  const body = h("tbody", { id: "jobs-body" });
  const more = h("button", { id: "jobs-more", hidden: true }, "Load more");
  const empty = h("p", { id: "jobs-empty", class: "hint", hidden: true }, "No jobs here yet.");
  const live = h("span", { id: "jobs-live", class: "hint" }, "");
  // Jobs picked for comparison (at most 20: what GET /v1/jobs/compare takes).
  const selected = new Set();
  const compare = h(
    "button",
    {
      id: "compare-selected",
      disabled: true,
      onclick: () => {
        location.hash = `#/compare?ids=${[...selected].map(encodeURIComponent).join(",")}`;
      },
    },
    "Compare",
  );
  const onSelect = (id, on) => {
    if (on) selected.add(id);
    else selected.delete(id);
    compare.disabled = selected.size < 2 || selected.size > 20;
    compare.textContent = selected.size ? `Compare ${selected.size}` : "Compare";
  };
  const makeRow = (job) => row(job, selected, onSelect);
  ctx.main.replaceChildren(
    h(
      "div",
      { class: "page-head" },
      h("h1", {}, "Jobs"),
      h("label", { for: "status-filter", class: "inline" }, "Status "),
      select,
      live,
      h("span", { class: "spacer" }),
      compare,
      h("a", { href: "#/jobs/new", class: "button" }, "New job"),
    ),
    h(
      "table",
      { class: "table", id: "jobs-table" },
      h("thead", {}, h("tr", {}, ...["", "Name", "Type", "Status", "Progress", "Detail", "Best top-1", "Age", "Duration", "Id"].map((t) => h("th", {}, t)))),
      body,
    ),
    empty,
    more,
  );

  const rows = new Map();
  let cursor = null;
  const query = () => {
    const q = new URLSearchParams();
    for (const s of wanted) q.append("status", s);
    q.set("limit", "50");
    if (cursor) q.set("cursor", cursor);
    return q.toString();
  };
  const load = async () => {
    const page = await api(`/v1/jobs?${query()}`);
    for (const job of page.items) {
      if (rows.has(job.id)) continue;
      const tr = makeRow(job);
      rows.set(job.id, tr);
      body.append(tr);
    }
    cursor = page.next_cursor;
    more.hidden = !cursor;
    empty.hidden = rows.size > 0;
  };
  more.addEventListener("click", load);
  await load();

  const timer = setInterval(() => rows.forEach((tr) => tr.tick()), 1000);
  ctx.onLeave(() => clearInterval(timer));

  const events = new EventSource("/v1/jobs/events");
  ctx.onLeave(() => events.close());
  events.onopen = () => {
    live.textContent = "live";
  };
  events.onerror = () => {
    live.textContent = "reconnecting…";
  };
  events.addEventListener("job", (e) => {
    const change = JSON.parse(e.data);
    const old = rows.get(change.id);
    // A change carries the list's live fields; the rest (type, model, command) is kept.
    const job = old ? { ...old.job, ...change } : change;
    const matches = !wanted.length || wanted.includes(job.status);
    if (old && !matches && FINAL.has(job.status)) {
      old.remove();
      rows.delete(job.id);
    } else if (old) {
      const tr = makeRow(job);
      old.replaceWith(tr);
      rows.set(job.id, tr);
    } else if (matches) {
      const tr = makeRow(job);
      rows.set(job.id, tr);
      body.prepend(tr);
    }
    empty.hidden = rows.size > 0;
  });
}
