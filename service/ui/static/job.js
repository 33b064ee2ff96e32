// A job's page: status, waiting reason, failure, progress with ETA, attempts and restarts,
// live charts (history from /metrics/series, then points from /events), per-rank logs that
// follow, the owner's tags and note, and the cancel / download / register / clone / delete
// buttons. Each job type shows what it has: a training job the trainer's four charts and its
// effective learning rate, a script job a chart per metric it reported and its MLflow runs'
// params and tags, an evaluation its
// results (top-1, top-5 and loss, a per-class precision/recall/F1 table and the confusion
// matrix as a heat map).

import { api, followText } from "./api.js";
import { LineChart } from "./chart.js";
import {
  h,
  fill,
  badge,
  duration,
  secondsSince,
  when,
  errorBox,
  FINAL,
  isFraction,
  metricText,
  percent,
  processCount,
  effectiveLrText,
} from "./dom.js";

// The charts of the built-in trainer's metrics; any other metric (a script's) gets its own.
// The loss spans orders of magnitude: its axis is logarithmic.
const CHARTS = [
  { id: "loss", title: "Loss (log scale)", log: true, series: [{ name: "train.loss", label: "train loss" }, { name: "val.loss", label: "val loss" }] },
  { id: "accuracy", title: "Accuracy", percent: true, series: [{ name: "val.top1", label: "top-1" }, { name: "val.top5", label: "top-5" }] },
  { id: "lr", title: "Learning rate", series: [{ name: "train.lr", label: "learning rate" }] },
  { id: "throughput", title: "Images / second", series: [{ name: "train.images_per_sec", label: "images/s" }] },
];
// Each rank's system metrics (docs/operations.md), charted in their own group as they arrive:
// every rank's points in one line per metric.
const SYSTEM_CHARTS = {
  "sys.cpu_percent": { id: "sys-cpu", title: "CPU % (100 = one core)", series: [{ name: "sys.cpu_percent", label: "CPU %" }] },
  "sys.rss_bytes": { id: "sys-rss", title: "Resident memory (bytes)", series: [{ name: "sys.rss_bytes", label: "RSS" }] },
  "sys.gpu_util": { id: "sys-gpu", title: "GPU utilization %", series: [{ name: "sys.gpu_util", label: "GPU %" }] },
  "sys.gpu_memory_bytes": { id: "sys-gpu-memory", title: "GPU memory (bytes)", series: [{ name: "sys.gpu_memory_bytes", label: "GPU memory" }] },
  "sys.input_wait_fraction": { id: "sys-input-wait", title: "Waiting on input", percent: true, series: [{ name: "sys.input_wait_fraction", label: "input wait" }] },
};
// Over this part of a step's time spent waiting on data (recently), the job is input-bound.
const INPUT_BOUND = 0.3;
const INPUT_RECENT = 8;
const MAX_LOG_CHARS = 400_000;

// The attempt now running (or last run): the one with the highest number.
function currentAttempt(job) {
  return (job.attempts || []).reduce((last, a) => (!last || a.number > last.number ? a : last), null);
}

// The time left, at the current attempt's own pace. A first attempt's pace is its steps
// over the time since it started. A later attempt resumes from a checkpoint's step, so
// neither the job's start nor its step count says its pace: that is measured on the page,
// from the first step seen in the attempt to the latest (pace keeps that first sighting).
function eta(job, pace) {
  const p = job.progress;
  if (!p || !p.total_steps || FINAL.has(job.status)) return null;
  const attempt = currentAttempt(job);
  const first = (job.attempts || []).length <= 1;
  const started = (attempt && attempt.started_at) || (first ? job.started_at : null);
  if (!started) return null;
  const left = Math.max(0, p.total_steps - p.step);
  if (first) {
    return p.step > 0 ? (secondsSince(started) * left) / p.step : null;
  }
  if (pace.attempt !== attempt.number || p.step < pace.step) {
    Object.assign(pace, { attempt: attempt.number, step: p.step, at: Date.now() });
  }
  const steps = p.step - pace.step;
  return steps > 0 ? (((Date.now() - pace.at) / 1000) * left) / steps : null;
}

function progressBlock(job, pace) {
  const p = job.progress;
  if (!p || !p.total_steps) return h("div", { id: "progress", class: "hint" }, FINAL.has(job.status) ? "" : "no progress yet");
  const fraction = Math.min(1, p.step / p.total_steps);
  // The API's estimate (the steps of the recent reports), else the page's own.
  const left = typeof p.eta_s === "number" && !FINAL.has(job.status) ? p.eta_s : eta(job, pace);
  return h(
    "div",
    { id: "progress" },
    h("progress", { max: "1", value: String(fraction) }),
    h(
      "span",
      { class: "hint" },
      ` epoch ${p.epoch}/${p.epochs}, step ${p.step}/${p.total_steps} (${Math.round(fraction * 100)}%)`,
      left !== null ? `, about ${duration(left)} left` : "",
    ),
  );
}

function failureBlock(job) {
  const f = job.failure;
  if (!f) return null;
  const where = [f.rank !== null && f.rank !== undefined ? `rank ${f.rank}` : null, f.node ? `node ${f.node}` : null]
    .filter(Boolean)
    .join(" on ");
  return h(
    "section",
    { id: "failure", class: "card failure" },
    h("h2", {}, `Failed: ${f.code}`),
    h("p", { id: "failure-message" }, f.message),
    where ? h("p", { class: "hint" }, where) : null,
    f.traceback ? h("details", { open: true }, h("summary", {}, "Traceback"), h("pre", { id: "traceback" }, f.traceback)) : null,
  );
}

// An ended attempt's reason ({code, message}: a failure code, preempted, succeeded or
// cancelled); an older service's bare failure code and message otherwise.
function endReason(a) {
  const r = a.end_reason;
  if (r && typeof r === "object") return [r.code, r.message].filter(Boolean).join(": ");
  return [r, a.failure_code, a.failure_message].filter(Boolean).join(": ");
}

function attemptsBlock(job) {
  const attempts = job.attempts || [];
  if (!attempts.length) return null;
  // Only a job with a restart budget (max_restarts) can restart: an evaluation has none.
  const budget = (job.resources || {}).max_restarts;
  const restarts =
    typeof budget === "number" && job.restarts !== undefined && job.restarts !== null
      ? h("p", { id: "restarts" }, `Restarts: ${job.restarts} of ${budget}`)
      : null;
  return h(
    "section",
    { id: "attempts", class: "card" },
    h("h2", {}, "Attempts"),
    restarts,
    h(
      "table",
      { class: "table" },
      h("thead", {}, h("tr", {}, ...["#", "Status", "Nodes", "Started", "Finished", "End reason"].map((t) => h("th", {}, t)))),
      h(
        "tbody",
        {},
        ...attempts.map((a) =>
          h(
            "tr",
            { class: "attempt-row", dataset: { attempt: String(a.number), status: a.status } },
            h("td", {}, a.number),
            h("td", {}, badge(a.status)),
            h("td", {}, (a.placements || []).length ? a.placements.map((p) => `${p.node} (${p.units})`).join(", ") : (a.nodes || []).join(", ")),
            h("td", {}, when(a.started_at)),
            h("td", {}, when(a.finished_at)),
            h("td", { class: "end-reason" }, endReason(a)),
          ),
        ),
      ),
    ),
  );
}

function specBlock(job) {
  const spec = {
    type: job.type,
    model: job.model,
    train_dataset: job.train_dataset,
    validation_dataset: job.validation_dataset,
    parameters: job.parameters,
    resources: job.resources,
    priority: job.priority,
  };
  for (const key of ["dataset", "batch_size", "code", "command", "distribution", "inputs", "environment", "outputs"]) {
    if (job[key] !== undefined) spec[key] = job[key];
  }
  for (const [k, v] of Object.entries(spec)) if (v === undefined || v === null) delete spec[k];
  return h("details", { id: "spec", class: "card" }, h("summary", {}, "Spec"), h("pre", {}, JSON.stringify(spec, null, 2)));
}

// A script's MLflow runs (job.tracking.runs): each run's name, status, rank, experiment
// (and attempt, once there are several) and a table of its params and tags, params first,
// each by key. MLflow's own mlflow.* tags are left out (GET /v1/jobs/{id} has them).
function trackingBlock(job) {
  const runs = ((job.tracking || {}).runs || []).filter((r) => r && typeof r === "object");
  if (!runs.length) return null;
  const attempts = new Set(runs.map((r) => r.attempt));
  const byKey = (a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0);
  const runBlock = (run) => {
    const params = Object.entries(run.params || {}).sort(byKey);
    const tags = Object.entries(run.tags || {}).filter(([k]) => !k.startsWith("mlflow.")).sort(byKey);
    const about = [`rank ${run.rank ?? 0}`, run.experiment ? `experiment ${run.experiment}` : null, attempts.size > 1 ? `attempt ${run.attempt}` : null];
    const row = (kind, key, value) => h("tr", { class: "tracking-row", dataset: { kind, key } }, h("td", { class: "hint" }, kind), h("td", { class: "mono" }, key), h("td", { class: "mono" }, String(value)));
    return h(
      "div",
      { class: "mlflow-run", dataset: { runId: run.id || "", runName: run.name || "" } },
      h("h3", {}, run.name || run.id || "run", " ", run.status ? badge(String(run.status).toLowerCase()) : null, " ", h("span", { class: "hint" }, about.filter(Boolean).join(", "))),
      params.length || tags.length
        ? h(
            "div",
            { class: "table-scroll" },
            h(
              "table",
              { class: "table tracking-table" },
              h("thead", {}, h("tr", {}, h("th", {}, "Kind"), h("th", {}, "Key"), h("th", {}, "Value"))),
              h("tbody", {}, ...params.map(([k, v]) => row("param", k, v)), ...tags.map(([k, v]) => row("tag", k, v))),
            ),
          )
        : h("p", { class: "hint" }, "No params or tags logged."),
    );
  };
  return h(
    "section",
    { id: "tracking", class: "card" },
    h("h2", {}, runs.length > 1 ? `MLflow runs (${runs.length})` : "MLflow run"),
    h("p", { class: "hint" }, "What the script logged with log_param(s) and set_tag; compare jobs to see them side by side."),
    ...runs.map(runBlock),
  );
}

const TYPE_NAMES = { train: "training (built-in trainer)", script: "script", evaluate: "evaluation" };

// The best validation values and their epoch: a training or script job that reported some.
function bestText(job) {
  const best = job.best || {};
  const values = Object.entries(best).filter(([k]) => k !== "attempt" && k !== "epoch");
  if (!values.length) return null;
  // Accuracy first: it is what a reader looks for.
  values.sort(([a], [b]) => Number(isFraction(b)) - Number(isFraction(a)));
  const text = values.map(([k, v]) => `${k} ${metricText(k, v)}`).join(", ");
  return typeof best.epoch === "number" ? `${text} (epoch ${best.epoch})` : text;
}

function modelLink(ref) {
  const [name, version] = String(ref).split(":");
  return h("a", { id: "evaluated-model", href: `#/models/${encodeURIComponent(name)}` }, version ? `${name} version ${version}` : name);
}

// The registry versions made from this job (filled in once /v1/models answers).
function registeredText(versions) {
  if (!versions || !versions.length) return null;
  return h(
    "span",
    { id: "registered-models" },
    ...versions.flatMap((v, i) => [
      i ? ", " : "",
      h("a", { href: `#/models/${encodeURIComponent(v.name)}`, class: "registered-model", dataset: { model: v.name, version: String(v.version) } }, `${v.name} version ${v.version}`),
    ]),
  );
}

function summaryBlock(job, extra) {
  const type = job.type || "train";
  const params = job.parameters || {};
  const rows = [
    ["Status", badge(job.status)],
    ["Type", TYPE_NAMES[type] || type],
    ["Waiting", job.reason || null],
    ["Model", type === "evaluate" && job.model ? modelLink(job.model) : null],
    ["Dataset", type === "evaluate" ? extra.datasetName || job.dataset : null],
    ["Command", type === "script" && job.command ? h("code", {}, job.command.join(" ")) : null],
    [
      "Learning rate",
      type === "train" && typeof params.learning_rate === "number"
        ? h("span", { id: "effective-lr" }, effectiveLrText(params.learning_rate, processCount(job.resources)))
        : null,
    ],
    ["Created", when(job.created_at)],
    ["Started", when(job.started_at)],
    ["Finished", when(job.finished_at)],
    ["Duration", job.started_at ? duration(secondsSince(job.started_at, job.finished_at)) : null],
    ["Nodes", (job.nodes || []).join(", ") || null],
    ["Best", type === "evaluate" ? null : bestText(job)],
    ["Registered", registeredText(extra.registered)],
  ].filter(([, v]) => v);
  const ids = { Waiting: "reason", Best: "best" };
  return h(
    "dl",
    { id: "summary", class: "summary" },
    ...rows.flatMap(([k, v]) => [h("dt", {}, k), h("dd", { id: ids[k] }, v)]),
  );
}

// An evaluation's results: the headline figures, a per-class table and the confusion
// matrix as a heat map (each row shaded by the share of that class's images).
function evaluationBlock(job) {
  const r = job.result && job.result.evaluation;
  if (!r) {
    const text = FINAL.has(job.status) ? "This evaluation has no results." : "The results show here when the evaluation ends.";
    return h("section", { id: "evaluation", class: "card" }, h("h2", {}, "Results"), h("p", { class: "hint" }, text));
  }
  const headline = [`top-1 ${percent(r.top1, 2)}`];
  if (typeof r.top5 === "number") headline.push(`top-5 ${percent(r.top5, 2)}`);
  headline.push(`loss ${+r.loss.toFixed(4)}`);
  const perClass = h(
    "table",
    { class: "table", id: "eval-per-class" },
    h("thead", {}, h("tr", {}, ...["Class", "Precision", "Recall", "F1", "Images"].map((t, i) => h("th", { class: i ? "num" : undefined }, t)))),
    h(
      "tbody",
      {},
      ...r.per_class.map((c) =>
        h(
          "tr",
          { class: "class-row", dataset: { label: c.label } },
          h("td", {}, c.label),
          h("td", { class: "num" }, percent(c.precision)),
          h("td", { class: "num" }, percent(c.recall)),
          h("td", { class: "num" }, percent(c.f1)),
          h("td", { class: "num" }, c.support),
        ),
      ),
    ),
  );
  return h(
    "section",
    { id: "evaluation", class: "card" },
    h("h2", {}, "Results"),
    h("p", { id: "eval-summary" }, `${headline.join(", ")} on ${r.num_images} images`),
    h("div", { class: "eval-grid" }, h("div", {}, h("h3", {}, "Per class"), perClass), confusionBlock(r)),
  );
}

const MAX_HEATMAP_CLASSES = 100;

function confusionBlock(r) {
  const classes = r.classes || [];
  if (classes.length > MAX_HEATMAP_CLASSES) {
    return h("div", {}, h("h3", {}, "Confusion matrix"), h("p", { class: "hint" }, `${classes.length} classes: too many to draw (GET /v1/jobs/{id}/result has it).`));
  }
  const rows = r.confusion_matrix || [];
  const cell = (count, total, diagonal, truth, predicted) => {
    const share = total ? count / total : 0;
    const td = h(
      "td",
      { class: `cm-cell num${diagonal ? " diagonal" : ""}${share > 0.55 ? " dark" : ""}`, title: `true ${truth}, predicted ${predicted}: ${count} of ${total} images`, dataset: { count: String(count) } },
      count ? String(count) : "",
    );
    // Right answers in blue, mistakes in red, darker for a larger share of the class (set
    // through the CSSOM: the page's policy allows no inline style attributes).
    if (count) td.style.backgroundColor = `rgba(${diagonal ? "37, 99, 235" : "220, 38, 38"}, ${(0.08 + 0.82 * share).toFixed(3)})`;
    return td;
  };
  return h(
    "div",
    {},
    h("h3", {}, "Confusion matrix"),
    h("p", { class: "hint" }, "Rows: true class; columns: predicted class. Shade: share of the row's images."),
    h(
      "table",
      { class: "table heatmap", id: "confusion-matrix" },
      h("thead", {}, h("tr", {}, h("th", {}, "true ↓ predicted →"), ...classes.map((c) => h("th", { class: "num" }, c)))),
      h(
        "tbody",
        {},
        ...rows.map((row, i) => {
          const total = row.reduce((a, b) => a + b, 0);
          return h("tr", { dataset: { label: classes[i] } }, h("th", {}, classes[i]), ...row.map((n, j) => cell(n, total, i === j, classes[i], classes[j])));
        }),
      ),
    ),
  );
}

function registerForm(ctx, job, container, onRegistered) {
  const name = h("input", { id: "register-name", value: job.name.replace(/[^A-Za-z0-9._-]/g, "-") });
  const out = h("span", { id: "register-result", class: "hint" });
  const form = h(
    "form",
    {
      id: "register-form",
      class: "inline-form",
      onsubmit: async (e) => {
        e.preventDefault();
        try {
          const v = await api("/v1/models", { method: "POST", json: { name: name.value, job_id: job.id } });
          out.replaceChildren(`registered ${v.name} version ${v.version}: `, h("a", { id: "register-link", href: `#/models/${encodeURIComponent(v.name)}` }, "open the model"));
          if (onRegistered) onRegistered(v);
        } catch (err) {
          out.textContent = err.message;
        }
      },
    },
    h("label", { for: "register-name" }, "Model name "),
    name,
    h("button", { type: "submit" }, "Register"),
    out,
  );
  container.replaceChildren(form);
}

function actions(ctx, job, refresh, onRegistered) {
  const box = h("div", { id: "actions", class: "actions" });
  const extra = h("div", { id: "action-extra" });
  if (!FINAL.has(job.status)) {
    box.append(
      h(
        "button",
        {
          id: "cancel",
          class: "danger",
          disabled: job.status === "cancelling",
          onclick: async () => {
            if (!confirm(`Cancel job ${job.name}?`)) return;
            try {
              await api(`/v1/jobs/${job.id}/cancel`, { method: "POST" });
            } catch (err) {
              extra.replaceChildren(errorBox(err));
            }
            refresh();
          },
        },
        "Cancel",
      ),
    );
  }
  if (job.status === "succeeded" && job.model_sha256) {
    box.append(h("a", { id: "download-model", class: "button", href: `/v1/jobs/${job.id}/model`, download: "" }, "Download model"));
  }
  if (ctx.features.outputs && job.type === "script" && FINAL.has(job.status)) {
    box.append(h("a", { id: "download-outputs", class: "button", href: `/v1/jobs/${job.id}/outputs`, download: "" }, "Download outputs"));
  }
  if (ctx.features.models && job.status === "succeeded" && job.model_sha256 && (job.type || "train") === "train") {
    box.append(h("button", { id: "register", onclick: () => registerForm(ctx, job, extra, onRegistered) }, "Register model"));
  }
  box.append(...lifecycleButtons(job, extra));
  return [box, extra];
}

// Clone (submit the same spec again, any status) and Delete (a finished job, with its
// metrics, logs, checkpoints and files; the service refuses with 409 and says why).
function lifecycleButtons(job, extra) {
  const clone = h(
    "button",
    {
      id: "clone",
      title: "Submit this job's spec again as a new job",
      onclick: async () => {
        try {
          const copy = await api(`/v1/jobs/${job.id}/clone`, { method: "POST" });
          location.hash = `#/jobs/${encodeURIComponent(copy.id)}`;
        } catch (err) {
          extra.replaceChildren(errorBox(err));
        }
      },
    },
    "Clone",
  );
  if (!FINAL.has(job.status)) return [clone];
  const remove = h(
    "button",
    {
      id: "delete",
      class: "danger",
      onclick: async () => {
        if (!confirm(`Delete job ${job.name} with its metrics, logs, checkpoints and files? This cannot be undone.`)) return;
        try {
          await api(`/v1/jobs/${job.id}`, { method: "DELETE" });
          location.hash = "#/jobs";
        } catch (err) {
          extra.replaceChildren(errorBox(err));
        }
      },
    },
    "Delete",
  );
  return [clone, remove];
}

// The owner's tags and note, with an inline editor (PATCH /v1/jobs/{id}).
function labelsBlock(job, refresh) {
  const box = h("section", { id: "labels", class: "card" });
  const show = () => {
    const tags = (job.tags || []).map((t) => h("span", { class: "tag" }, t));
    fill(
      box,
      h(
        "div",
        { class: "page-head" },
        h("h2", {}, "Tags and note"),
        h("span", { id: "job-tags" }, ...(tags.length ? tags : [h("span", { class: "hint" }, "no tags")])),
        h("span", { class: "spacer" }),
        h("button", { id: "edit-labels", onclick: edit }, "Edit"),
      ),
      job.note ? h("p", { id: "job-note", class: "note" }, job.note) : null,
    );
  };
  const edit = () => {
    const tags = h("input", { id: "tags-input", value: (job.tags || []).join(" "), placeholder: "baseline lr-0.05" });
    const note = h("textarea", { id: "note-input", rows: "3", maxlength: "10000" });
    note.value = job.note || "";
    const out = h("div", { id: "labels-error" });
    box.replaceChildren(
      h(
        "form",
        {
          id: "labels-form",
          onsubmit: async (e) => {
            e.preventDefault();
            const list = tags.value.split(/[\s,]+/).filter(Boolean);
            try {
              Object.assign(job, await api(`/v1/jobs/${job.id}`, { method: "PATCH", json: { tags: list, note: note.value.trim() || null } }));
              show();
              refresh();
            } catch (err) {
              out.replaceChildren(errorBox(err));
            }
          },
        },
        h("label", { for: "tags-input" }, "Tags (separated by spaces) "),
        tags,
        h("label", { for: "note-input" }, "Note "),
        note,
        h("div", { class: "actions" }, h("button", { type: "submit", id: "save-labels" }, "Save"), h("button", { type: "button", onclick: show }, "Cancel")),
        out,
      ),
    );
    tags.focus();
  };
  show();
  return box;
}

// The recent waits on input of every rank, and the note saying a job is input-bound.
function inputWatch(note) {
  const recent = [];
  const show = () => {
    const mean = recent.length ? recent.reduce((a, b) => a + b, 0) / recent.length : 0;
    note.hidden = !(mean > INPUT_BOUND);
    note.textContent = `input-bound: waiting on data ${Math.round(mean * 100)} % of the time`;
  };
  return (values) => {
    recent.push(...values);
    recent.splice(0, Math.max(0, recent.length - INPUT_RECENT));
    show();
  };
}

async function setUpCharts(ctx, job, grid, seriesPromise, defs, system) {
  const charts = [];
  const byMetric = new Map();
  const add = (def) => {
    const root = h("div", { id: `chart-${def.id}`, class: "chart-box" });
    if (system && SYSTEM_CHARTS[def.series[0].name]) {
      system.head.hidden = false;
      system.grid.append(root);
    } else {
      grid.append(root);
    }
    const chart = new LineChart(root, def);
    charts.push(chart);
    for (const s of def.series) byMetric.set(s.name, chart);
    return chart;
  };
  for (const def of defs) add(def);
  ctx.onLeave(() => charts.forEach((c) => c.destroy()));
  const ensure = (name) => {
    const found = byMetric.get(name);
    if (found) return found;
    if (SYSTEM_CHARTS[name] && system) return add(SYSTEM_CHARTS[name]);
    grid.querySelector(".no-metrics")?.remove();
    return add({ id: name.replace(/[^A-Za-z0-9_-]/g, "-"), title: name, percent: isFraction(name), log: /loss$/.test(name), series: [{ name, label: name }] });
  };

  const started = performance.now();
  const page = await seriesPromise;
  for (const [name, s] of Object.entries(page.series)) ensure(name).setData(name, s.x, s.y);
  const waits = page.series["sys.input_wait_fraction"];
  if (system && waits) system.waited(waits.y.slice(-INPUT_RECENT));
  if (!charts.length) grid.append(h("p", { class: "hint no-metrics" }, "No metrics reported yet."));
  await new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
  grid.dataset.loadedMs = String(Math.round(performance.now() - started));
  grid.dataset.ready = "true";
  performance.mark("torchyard:charts-ready");
  return { ensure, lastSeq: page.last_seq };
}

// Per-rank and agent logs of the latest attempt, or of an earlier one picked in the attempt
// list (logs?attempt=N); an ended attempt's log is read to its end, a live one followed.
// Nothing is fetched before start() (called once the charts are drawn).
function logsBlock(ctx, job) {
  const select = h("select", { id: "log-stream" });
  const attemptSelect = h("select", { id: "log-attempt" });
  const attemptLabel = h("label", { for: "log-attempt", class: "inline" }, "Attempt ");
  const pre = h("pre", { id: "log", class: "log" });
  const state = h("span", { id: "log-state", class: "hint" });
  let controller = null;
  let chosen = null;
  let attempt = ""; // "" is the latest attempt
  let generation = 0;

  const follow = (name) => {
    if (controller) controller.abort();
    controller = new AbortController();
    chosen = name;
    pre.textContent = "";
    pre.dataset.attempt = attempt;
    state.textContent = "following…";
    const signal = controller.signal;
    const q = new URLSearchParams({ follow: "true" });
    q.set("stream", name);
    if (attempt) q.set("attempt", attempt);
    followText(
      `/v1/jobs/${job.id}/logs?${q}`,
      (text) => {
        const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 8;
        let value = pre.textContent + text;
        if (value.length > MAX_LOG_CHARS) value = value.slice(value.length - MAX_LOG_CHARS);
        pre.textContent = value;
        if (atBottom) pre.scrollTop = pre.scrollHeight;
      },
      signal,
    )
      .then(() => {
        if (!signal.aborted) state.textContent = "end of log";
      })
      .catch((err) => {
        if (!signal.aborted) state.textContent = err.message;
      });
  };

  const refreshStreams = async () => {
    const mine = generation;
    let listing;
    try {
      listing = await api(`/v1/jobs/${job.id}/logs/streams${attempt ? `?attempt=${encodeURIComponent(attempt)}` : ""}`);
    } catch {
      return false;
    }
    if (mine !== generation) return false; // another attempt was picked meanwhile
    const names = (listing.streams || []).map((s) => s.name);
    const current = Array.from(select.options).map((o) => o.value);
    if (names.join() !== current.join()) {
      const keep = (chosen && names.includes(chosen) && chosen) || names.find((n) => n === "rank-0") || names[0];
      select.replaceChildren(...names.map((n) => h("option", { value: n, selected: n === keep }, n)));
    }
    if (!chosen && names.length) follow(select.value);
    return names.length > 0;
  };
  select.addEventListener("change", () => follow(select.value));
  attemptSelect.addEventListener("change", () => {
    generation += 1;
    attempt = attemptSelect.value;
    if (controller) controller.abort();
    controller = null;
    chosen = null;
    pre.textContent = "";
    state.textContent = "";
    select.replaceChildren();
    refreshStreams();
  });
  // The attempt list follows the job's attempts; it shows once there is more than one.
  const setAttempts = (j) => {
    const attempts = j.attempts || [];
    const wanted = ["", ...attempts.map((a) => String(a.number))];
    const labels = ["latest", ...attempts.map((a) => `#${a.number} ${a.status}`)];
    const current = Array.from(attemptSelect.options).map((o) => `${o.value}=${o.textContent}`);
    const next = wanted.map((v, i) => `${v}=${labels[i]}`);
    if (current.join() !== next.join()) {
      attemptSelect.replaceChildren(...wanted.map((v, i) => h("option", { value: v, selected: v === attempt }, labels[i])));
    }
    const many = attempts.length > 1;
    attemptSelect.hidden = !many;
    attemptLabel.hidden = !many;
  };
  setAttempts(job);
  let timer = null;
  let left = false;
  ctx.onLeave(() => {
    left = true;
    clearInterval(timer);
    if (controller) controller.abort();
  });
  const start = () => {
    if (left || timer !== null) return;
    timer = setInterval(refreshStreams, 2000);
    refreshStreams();
  };
  const el = h(
    "section",
    { id: "logs", class: "card" },
    h(
      "div",
      { class: "page-head" },
      h("h2", {}, "Logs"),
      attemptLabel,
      attemptSelect,
      h("label", { for: "log-stream", class: "inline" }, "Stream "),
      select,
      state,
    ),
    pre,
  );
  return { el, setAttempts, start };
}

// What the summary shows beside the job itself: an evaluation's dataset name and the model
// versions registered from the job (asked for after the charts are drawn).
async function loadExtra(ctx, job, extra) {
  const tasks = [];
  if (job.type === "evaluate" && job.dataset) {
    tasks.push(
      api(`/v1/datasets/${encodeURIComponent(job.dataset)}`)
        .then((d) => (extra.datasetName = `${d.name} (${d.num_images} images)`))
        .catch(() => {}),
    );
  }
  if (ctx.features.models && job.type !== "evaluate" && job.status === "succeeded") {
    tasks.push(
      api("/v1/models")
        .then((page) => {
          const versions = (page.items || []).flatMap((m) => (m.versions || []).filter((v) => v.job_id === job.id));
          extra.registered = versions;
        })
        .catch(() => {}),
    );
  }
  await Promise.all(tasks);
}

export async function renderJob(ctx, jobId) {
  // The job and its chart series are asked for at once.
  const seriesPromise = api(`/v1/jobs/${encodeURIComponent(jobId)}/metrics/series?points=2000`);
  seriesPromise.catch(() => {});
  let job = await api(`/v1/jobs/${encodeURIComponent(jobId)}`);
  const type = job.type || "train";
  const head = h("div", { class: "page-head" });
  const status = h("div", { id: "job-status" });
  const grid = h("div", { id: "charts", class: "charts" });
  const inputNote = h("p", { id: "input-bound", class: "input-bound", hidden: true });
  const system = {
    head: h("h2", { id: "system-head", hidden: true }, "System"),
    grid: h("div", { id: "system-charts", class: "charts" }),
    waited: inputWatch(inputNote),
  };
  const results = h("div", { id: "results" });
  const extra = {};
  const pace = {};
  const refresh = async () => {
    try {
      job = await api(`/v1/jobs/${encodeURIComponent(jobId)}`);
    } catch {
      return;
    }
    draw();
  };
  const logs = logsBlock(ctx, job);
  // A version registered here shows in the summary at once (the form stays open).
  const onRegistered = (v) => {
    extra.registered = [...(extra.registered || []), v];
    status.querySelector("#summary")?.replaceWith(summaryBlock(job, extra));
  };
  let labels = null;
  const draw = () => {
    logs.setAttempts(job);
    head.replaceChildren(h("h1", { id: "job-name" }, job.name), badge(job.status), h("span", { class: "spacer" }), ...actions(ctx, job, refresh, onRegistered));
    if (!status.contains(document.getElementById("labels-form"))) labels = labelsBlock(job, refresh);
    fill(status, summaryBlock(job, extra), progressBlock(job, pace), failureBlock(job), labels, trackingBlock(job), attemptsBlock(job), specBlock(job));
    if (type === "evaluate") results.replaceChildren(evaluationBlock(job));
  };
  draw();
  // An evaluation has results, not training curves; a script charts the metrics it reports.
  const metricsHead = h("h2", { id: "metrics-head" }, "Metrics");
  if (type === "evaluate") {
    ctx.main.replaceChildren(head, status, results, logs.el);
  } else {
    ctx.main.replaceChildren(head, status, inputNote, metricsHead, grid, system.head, system.grid, logs.el);
  }

  // The charts come first: the logs, the progress tick and the live points wait for them.
  let charted;
  try {
    charted = await setUpCharts(ctx, job, type === "evaluate" ? h("div") : grid, seriesPromise, type === "train" ? CHARTS : [], system);
  } finally {
    logs.start();
    loadExtra(ctx, job, extra).then(() => (extra.datasetName || extra.registered ? draw() : null));
  }
  const { ensure, lastSeq } = charted;
  const tick = setInterval(() => {
    if (!FINAL.has(job.status)) status.querySelector("#progress")?.replaceWith(progressBlock(job, pace));
  }, 5000);
  ctx.onLeave(() => clearInterval(tick));
  if (FINAL.has(job.status)) return;

  const q = new URLSearchParams({ logs: "false", resume: `s0.m${lastSeq}.l0` });
  const events = new EventSource(`/v1/jobs/${job.id}/events?${q}`);
  ctx.onLeave(() => events.close());
  events.addEventListener("metric", (e) => {
    const p = JSON.parse(e.data);
    ensure(p.name).append(p.name, p.step, p.value);
    if (p.name === "sys.input_wait_fraction") system.waited([p.value]);
  });
  let pending = null;
  events.addEventListener("status", (e) => {
    const s = JSON.parse(e.data);
    if (s.final) events.close();
    clearTimeout(pending);
    pending = setTimeout(refresh, 100);
  });
  events.addEventListener("end", () => events.close());
  // Progress and the waiting reason change without a status event: refresh now and then.
  const poll = setInterval(() => (FINAL.has(job.status) ? clearInterval(poll) : refresh()), 3000);
  ctx.onLeave(() => clearInterval(poll));
}
