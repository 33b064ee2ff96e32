// DOM helpers: elements are built with textContent only (never innerHTML), so nothing a
// user or a worker wrote can become markup.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "value") el.value = value;
    else if (value === true) el.setAttribute(key, "");
    else el.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

// el.replaceChildren(...children) leaving out null, undefined and false (which
// replaceChildren would write as the text "null"): for children shown only sometimes.
export function fill(el, ...children) {
  el.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}

export const FINAL = new Set(["succeeded", "failed", "cancelled"]);

export function badge(status) {
  return h("span", { class: `badge status-${status}`, dataset: { status } }, status);
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function secondsSince(iso, until) {
  if (!iso) return null;
  const end = until ? Date.parse(until) : Date.now();
  return (end - Date.parse(iso)) / 1000;
}

export function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n, i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "";
}

export function errorBox(err) {
  return h("div", { class: "error", role: "alert" }, err.code ? `${err.code}: ` : "", err.message || String(err));
}

// Accuracy-like metrics (top-1, top-5, accuracy, precision, recall, F1) are fractions 0-1
// in the API; the UI shows them as percentages, as the CLI does.
export function isFraction(name) {
  return /(^|[._])(top\d+|acc|accuracy|precision|recall|f1)$/i.test(String(name));
}

export function percent(v, digits = 1) {
  return typeof v === "number" && Number.isFinite(v) ? `${(v * 100).toFixed(digits)}%` : "";
}

// A metric's value as the UI shows it: a percentage for accuracy-like names, else at most
// four decimals.
export function metricText(name, v) {
  if (typeof v !== "number") return String(v);
  return isFraction(name) ? percent(v, 2) : String(+v.toFixed(4));
}

// The training processes of a job (nodes x processes per node): the built-in trainer
// scales the learning rate by it.
export function processCount(resources) {
  const r = resources || {};
  return (Number(r.node_count) || 1) * (Number(r.process_count_per_node) || 1);
}

// These two say what torchyard/contract/learning_rate.py says (LearningRateSchedule's
// effective_text and schedule_text), which the trainer and `torchyard show` use.
export function effectiveLrText(lr, processes) {
  if (typeof lr !== "number" || !Number.isFinite(lr)) return "";
  const eff = +(lr * processes).toPrecision(6);
  return processes > 1 ? `${lr} × ${processes} processes = ${eff} effective` : `${lr} (1 process: effective ${eff})`;
}

export function lrScheduleText(warmupEpochs, epochs) {
  const warmup = Number(warmupEpochs) || 0;
  const start = warmup > 0 ? `reached after a linear warm-up over the first ${warmup === 1 ? "epoch" : `${warmup} epochs`}` : "from the first step";
  return `${start}, then a linear decay to 0 at the end of epoch ${Number(epochs) || "?"}`;
}

// A number as a person reads it: integers whole, others to `digits` significant digits
// (0.017439263563117445 is 0.01744); anything else as text ("–" when missing).
export function sig(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return typeof v === "object" ? JSON.stringify(v) : String(v);
  if (!Number.isFinite(v) || Number.isInteger(v)) return String(v);
  return String(Number(v.toPrecision(digits)));
}

// Readable names for the fields of a job spec (their keys stay in a title).
const LABELS = {
  architecture: "Architecture",
  pretrained: "Pretrained weights",
  memory_efficient: "Memory-efficient",
  init_from_job: "Start from job",
  epochs: "Epochs",
  batch_size: "Batch size (per process)",
  warmup_epochs: "Warm-up epochs",
  learning_rate: "Learning rate",
  random_seed: "Random seed",
  patience: "Patience (epochs)",
  print_frequency: "Print every (steps)",
  image_size: "Image size (px)",
  augmentation: "Augmentation",
  node_count: "Nodes",
  process_count_per_node: "Processes per node",
  max_runtime_s: "Time limit (s)",
  max_restarts: "Max restarts",
  priority: "Priority",
  launch: "Launch",
};

export function fieldLabel(key) {
  const name = String(key).split(".").pop();
  if (LABELS[name]) return LABELS[name];
  const words = name.replace(/_s$/, " (s)").replace(/_/g, " ");
  return words.charAt(0).toUpperCase() + words.slice(1);
}
