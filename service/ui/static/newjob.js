// The new-job form, for each job type: a training job (one input per field of the service's
// own TrainJobCreate schema, so every parameter shows its range and default; the
// architecture from a list; the effective learning rate), a script job (a code package and
// its command) and an evaluation (a registered model version on a dataset). Each 422 shows
// next to its field.

import { api, ApiError, jsonWithIntegers } from "./api.js";
import { h, errorBox, processCount, effectiveLrText, lrScheduleText, fieldLabel, sig } from "./dom.js";

// Used when the schema cannot be read: the fields of docs/datasets.md.
const FALLBACK = {
  model: { architecture: { type: "string", default: "resnet18" }, pretrained: { type: "boolean", default: false } },
  parameters: {
    epochs: { type: "integer", default: 5 },
    batch_size: { type: "integer", default: 16 },
    learning_rate: { type: "number", default: 0.001 },
    image_size: { type: "integer", default: 224 },
  },
  resources: { node_count: { type: "integer", default: 1 }, process_count_per_node: { type: "integer", default: 1 } },
};
const FALLBACK_PRIORITY = { type: "integer", default: 0, minimum: -100, maximum: 100 };

// Where a training job's form starts. The service's defaults (224 px, standard augmentation,
// learning rate 0.001) suit photographs; on small images such as the demo's 8×8 digits they
// train slowly and poorly, and the README and `torchyard demo` use 32 px, light
// augmentation and a learning rate of 0.02 with one warm-up epoch instead.
const PRESETS = {
  small: {
    label: "small images (up to 64 px)",
    values: { "parameters.image_size": 32, "parameters.augmentation": "light", "parameters.learning_rate": 0.02, "parameters.warmup_epochs": 1, "parameters.batch_size": 32 },
  },
  photos: { label: "photographs (224 px)", values: {} },
};
const FIRST_PRESET = "small";

function resolve(schema, node) {
  let cur = node || {};
  for (let i = 0; i < 5 && cur.$ref; i++) cur = schema.components.schemas[cur.$ref.split("/").pop()] || {};
  if (cur.allOf && cur.allOf.length === 1) return { ...cur, ...resolve(schema, cur.allOf[0]) };
  return cur;
}

// The training job's request schema: TrainJobCreate where jobs of several types are
// accepted, JobCreate on a service with training jobs only, else whichever request
// (…Create) schema has a model, parameters and resources (never JobPublic, an answer).
function createSchema(schema) {
  const all = (schema && schema.components && schema.components.schemas) || {};
  const fits = (s) => s && s.properties && ["model", "parameters", "resources"].every((k) => k in s.properties);
  return [all.TrainJobCreate, all.JobCreate].find(fits) || Object.entries(all).find(([n, s]) => n.endsWith("Create") && fits(s))?.[1];
}

// The job's top-level priority (its range and default).
function priorityProp(schema) {
  const prop = createSchema(schema)?.properties?.priority;
  return prop ? { ...resolve(schema, prop), ...prop } : FALLBACK_PRIORITY;
}

// {section: {field: property schema}} from the JobCreate schema.
function sections(schema) {
  const create = createSchema(schema);
  if (!create) return FALLBACK;
  const out = {};
  for (const section of ["model", "parameters", "resources"]) {
    const s = resolve(schema, create.properties[section]);
    if (s.properties) {
      out[section] = {};
      for (const [name, prop] of Object.entries(s.properties)) {
        out[section][name] = { ...resolve(schema, prop), ...prop };
        if (name === "architecture" && out[section][name].default === undefined) out[section][name].default = "resnet18";
      }
    }
  }
  return Object.keys(out).length === 3 ? out : FALLBACK;
}

function kind(prop) {
  const types = prop.anyOf ? prop.anyOf.map((t) => t.type) : [prop.type];
  const nullable = types.includes("null");
  const type = types.find((t) => t && t !== "null") || "string";
  const choices = prop.enum || prop["x-choices"] || (prop.anyOf || []).find((t) => t.enum)?.enum;
  return { type, nullable, choices };
}

// The integers' cap (2³¹−1), which every integer field has: not worth a word in each hint.
const INT_CAP = /,? and <= 2147483647\b/;

// A field's allowed range as a person reads it: "> 0" for the smallest positive float
// (machine epsilon, 2.220446049250313e-16), "empty" for null (an empty field sends it),
// long decimals shortened, ≥ and ≤.
export function readableRange(text) {
  return String(text)
    .replace(/>= ?([0-9.]+e-\d+)( and finite)?/, (m, n) => (Number(n) > 0 && Number(n) < 1e-9 ? "> 0" : m))
    .replace(INT_CAP, "")
    .replace(/\d+\.\d{5,}(e[-+]?\d+)?/g, (n) => sig(Number(n)))
    .replace(/\bnull\b/g, "empty")
    .replace(/>=/g, "≥")
    .replace(/<=/g, "≤");
}

function rangeText(prop) {
  if (prop.allowed) return readableRange(prop.allowed);
  const bits = [];
  if (prop.minimum !== undefined) bits.push(`>= ${prop.minimum}`);
  if (prop.exclusiveMinimum !== undefined) bits.push(`> ${prop.exclusiveMinimum}`);
  if (prop.maximum !== undefined) bits.push(`<= ${prop.maximum}`);
  return readableRange(bits.join(" and "));
}

function fieldRow(path, prop) {
  const { type, nullable, choices } = kind(prop);
  const id = `f-${path.replace(/\./g, "-")}`;
  let input;
  if (choices) {
    input = h("select", { id, name: path }, ...choices.map((c) => h("option", { value: c, selected: c === prop.default }, c)));
  } else if (type === "boolean") {
    input = h("input", { id, name: path, type: "checkbox", checked: prop.default === true });
  } else {
    const value = prop.default === null || prop.default === undefined ? "" : String(prop.default);
    input = h("input", {
      id,
      name: path,
      type: "text",
      inputmode: type === "string" ? undefined : type === "integer" ? "numeric" : "decimal",
      value,
      placeholder: nullable ? "empty: none" : "",
    });
  }
  input.dataset.type = type;
  if (nullable) input.dataset.nullable = "true";
  const range = rangeText(prop);
  const hint = [range ? `allowed: ${range}` : "", prop.default !== undefined ? `default: ${prop.default === null ? "none" : sig(prop.default)}` : ""]
    .filter(Boolean)
    .join("; ");
  // A readable label; the field's name in the spec (parameters.learning_rate) in its title.
  const key = path.replace(/^script\./, "");
  return h(
    "div",
    { class: "field", dataset: { field: path } },
    h("label", { for: id, title: key, dataset: { key } }, fieldLabel(key)),
    input,
    h("div", { class: "hint", title: prop.description || "" }, hint),
    h("div", { class: "field-error", id: `err-${id}` }),
  );
}

function readValue(input) {
  const type = input.dataset.type;
  if (input.type === "checkbox") return input.checked;
  const text = input.value.trim();
  if (text === "" && input.dataset.nullable) return null;
  if (type === "integer" && /^-?\d+$/.test(text)) return { __int: text };
  if (type === "number" && text !== "" && Number.isFinite(Number(text))) return Number(text);
  return text; // not a number: sent as typed, so the service's 422 names the field
}

function datasetPicker(path, label, datasets) {
  const id = `f-${path}`;
  return h(
    "div",
    { class: "field", dataset: { field: path } },
    h("label", { for: id }, label),
    h(
      "select",
      { id, name: path, required: true },
      h("option", { value: "" }, datasets.length ? "choose a dataset" : "no datasets: upload one first"),
      ...datasets.map((d) => h("option", { value: d.id }, `${d.name} (${d.num_images} images, ${d.classes.length} classes)`)),
    ),
    h("div", { class: "field-error", id: `err-${id}` }),
  );
}

// A request schema's property (its $ref and allOf resolved), or the fallback.
function propOf(schema, model, name, fallback) {
  const all = (schema && schema.components && schema.components.schemas) || {};
  const prop = all[model]?.properties?.[name];
  return prop ? { ...resolve(schema, prop), ...prop } : fallback;
}

// The fields of one section ({field: property}) of a request schema (ScriptJobCreate.resources).
function sectionOf(schema, model, section, fallback) {
  const all = (schema && schema.components && schema.components.schemas) || {};
  const s = resolve(schema, all[model]?.properties?.[section]);
  if (!s.properties) return fallback;
  return Object.fromEntries(Object.entries(s.properties).map(([n, p]) => [n, { ...resolve(schema, p), ...p }]));
}

function textField(path, label, attrs = {}, hint = "") {
  const id = `f-${path.replace(/\./g, "-")}`;
  return h(
    "div",
    { class: "field", dataset: { field: path } },
    h("label", { for: id }, label),
    h("input", { id, name: path, value: "", ...attrs }),
    h("div", { class: "hint" }, hint),
    h("div", { class: "field-error", id: `err-${id}` }),
  );
}

function selectField(path, label, options, [choose, none]) {
  const id = `f-${path.replace(/\./g, "-")}`;
  return h(
    "div",
    { class: "field", dataset: { field: path } },
    h("label", { for: id }, label),
    h("select", { id, name: path }, h("option", { value: "" }, options.length ? choose : none), ...options.map(([value, text]) => h("option", { value }, text))),
    h("div", { class: "hint" }),
    h("div", { class: "field-error", id: `err-${id}` }),
  );
}

// A command line split into its arguments as a shell would (quotes group; no expansion).
export function splitCommand(line) {
  const out = [];
  const re = /"((?:[^"\\]|\\.)*)"|'([^']*)'|(\S+)/g;
  let m;
  while ((m = re.exec(line))) out.push(m[1] !== undefined ? m[1].replace(/\\(.)/g, "$1") : m[2] !== undefined ? m[2] : m[3]);
  return out;
}

const TYPES = [
  ["train", "training (built-in trainer)"],
  ["script", "script (your own code)"],
  ["evaluate", "evaluation (a registered model on a dataset)"],
];

export async function renderNewJob(ctx) {
  const [datasets, code, models] = await Promise.all([
    api("/v1/datasets?limit=200").then((p) => p.items),
    api("/v1/code?limit=200").then((p) => p.items || []).catch(() => []),
    ctx.features.models ? api("/v1/models").then((p) => p.items || []).catch(() => []) : Promise.resolve([]),
  ]);
  const spec = sections(ctx.schema);
  const summary = h("div", { id: "form-error" });
  const wanted = ctx.params.get("type");
  const typeSelect = h(
    "select",
    { id: "f-type", name: "job_type" },
    ...TYPES.filter(([t]) => t !== "evaluate" || ctx.features.models).map(([value, text]) => h("option", { value, selected: value === wanted }, text)),
  );
  const priority = fieldRow("priority", priorityProp(ctx.schema));

  // Training.
  const groups = Object.entries(spec).map(([section, fields]) =>
    h("fieldset", { class: "card" }, h("legend", {}, section), ...Object.entries(fields).map(([name, prop]) => fieldRow(`${section}.${name}`, prop))),
  );
  const lrHint = h("div", { id: "effective-lr-hint", class: "hint lr-hint" });
  const preset = h("select", { id: "f-preset", name: "preset" }, ...Object.entries(PRESETS).map(([value, p]) => h("option", { value, selected: value === FIRST_PRESET }, p.label)));
  const train = h(
    "div",
    { id: "train-fields", dataset: { type: "train" } },
    h(
      "fieldset",
      { class: "card" },
      h("legend", {}, "data"),
      datasetPicker("train_dataset", "Training dataset", datasets),
      datasetPicker("validation_dataset", "Validation dataset", datasets),
      h(
        "div",
        { class: "field", dataset: { field: "preset" } },
        h("label", { for: "f-preset" }, "Settings for"),
        preset,
        h("div", { class: "hint" }, "fills image size, augmentation, learning rate, warm-up and batch size: 32 px, light, 0.02, 1 epoch and 32 for small images such as the demo's digits; for photographs the service's defaults (224 px, standard, 0.001, none, 16)"),
      ),
    ),
    ...groups,
  );
  // The preset's values, over the service's defaults (read from its schema).
  const applyPreset = () => {
    for (const input of train.querySelectorAll("fieldset [name*='.']")) {
      const [section, field] = input.name.split(".");
      const fallback = spec[section]?.[field]?.default;
      const value = input.name in PRESETS[preset.value].values ? PRESETS[preset.value].values[input.name] : fallback;
      if (value === undefined || input.type === "checkbox") continue;
      input.value = value === null ? "" : String(value);
    }
    train.dispatchEvent(new Event("input"));
  };
  preset.addEventListener("change", applyPreset);
  // The trainer scales the learning rate by the number of processes: say what it will be.
  const lrBox = train.querySelector(".field[data-field='parameters.learning_rate']");
  if (lrBox) lrBox.append(lrHint);
  const showLr = () => {
    const value = (sel) => train.querySelector(sel)?.value.trim();
    const lr = Number(value("#f-parameters-learning_rate"));
    const processes = processCount({ node_count: value("#f-resources-node_count"), process_count_per_node: value("#f-resources-process_count_per_node") });
    const schedule = lrScheduleText(value("#f-parameters-warmup_epochs"), value("#f-parameters-epochs"));
    lrHint.textContent = Number.isFinite(lr) && lr > 0 ? `effective: ${effectiveLrText(lr, processes)} (the learning rate is multiplied by the number of processes); ${schedule}` : "";
  };
  train.addEventListener("input", showLr);
  applyPreset();

  // Script.
  const scriptResources = sectionOf(ctx.schema, "ScriptJobCreate", "resources", FALLBACK.resources);
  const launch = propOf(ctx.schema, "DistributionFields", "launch", null) || sectionOf(ctx.schema, "ScriptJobCreate", "distribution", {}).launch;
  const script = h(
    "div",
    { id: "script-fields", dataset: { type: "script" } },
    h(
      "fieldset",
      { class: "card" },
      h("legend", {}, "script"),
      selectField("code", "Code package", code.map((c) => [c.id, `${c.name || c.id.slice(0, 8)} (${c.id.slice(0, 8)})`]), ["choose a code package", "no code packages: upload one with `torchyard code upload`"]),
      textField("command", "Command", { placeholder: "python train.py --epochs 3" }, "as you would type it; quotes group words; no shell"),
      selectField("inputs.data", "Input dataset (optional)", datasets.map((d) => [d.id, d.name]), ["none", "none (no datasets yet)"]),
      launch ? fieldRow("distribution.launch", launch) : null,
    ),
    h("fieldset", { class: "card" }, h("legend", {}, "resources"), ...Object.entries(scriptResources).map(([name, prop]) => fieldRow(`script.resources.${name}`, prop))),
  );
  // The dataset input is TORCHYARD_INPUT_DATA in the script's environment.
  script.querySelector(".field[data-field='inputs.data'] .hint").textContent = "its local path is in TORCHYARD_INPUT_DATA";

  // Evaluation.
  const versions = models.flatMap((m) => [...(m.versions || [])].reverse().map((v) => [`${m.name}:${v.version}`, `${m.name} version ${v.version}${typeof v.top1 === "number" ? ` (top-1 ${(v.top1 * 100).toFixed(1)}%)` : ""}`]));
  const batch = propOf(ctx.schema, "EvaluateJobCreate", "batch_size", { type: "integer", default: 64 });
  const evaluate = h(
    "div",
    { id: "evaluate-fields", dataset: { type: "evaluate" } },
    h(
      "fieldset",
      { class: "card" },
      h("legend", {}, "evaluation"),
      selectField("model", "Model version", versions, ["choose a model version", "no models: register one from a succeeded job's page"]),
      datasetPicker("dataset", "Dataset", datasets),
      fieldRow("batch_size", batch),
    ),
  );
  const parts = { train, script, evaluate };

  const form = h(
    "form",
    { id: "new-job-form", novalidate: true },
    h(
      "fieldset",
      { class: "card" },
      h("legend", {}, "job"),
      h("div", { class: "field", dataset: { field: "type" } }, h("label", { for: "f-type" }, "Type"), typeSelect, h("div", { class: "hint" }), h("div", { class: "field-error", id: "err-f-type" })),
      h("div", { class: "field", dataset: { field: "name" } }, h("label", { for: "f-name" }, "Name"), h("input", { id: "f-name", name: "name", value: "" }), h("div", { class: "hint" }, "empty: a name is made up"), h("div", { class: "field-error", id: "err-f-name" })),
      priority,
    ),
    train,
    script,
    evaluate,
    summary,
    h("button", { type: "submit", id: "submit-job" }, "Submit job"),
  );
  const showType = () => {
    for (const [type, el] of Object.entries(parts)) el.hidden = type !== typeSelect.value;
    form.setAttribute("data-type", typeSelect.value);
  };
  typeSelect.addEventListener("change", showType);
  showType();

  const bodyOf = (type) => {
    const body = { type };
    const name = form.querySelector("#f-name").value.trim();
    if (name) body.name = name;
    body.priority = readValue(form.querySelector("#f-priority"));
    if (type === "train") {
      Object.assign(body, { model: {}, parameters: {}, resources: {} });
      body.train_dataset = form.querySelector("#f-train_dataset").value;
      body.validation_dataset = form.querySelector("#f-validation_dataset").value;
      for (const input of train.querySelectorAll("fieldset [name*='.']")) {
        const [section, field] = input.name.split(".");
        body[section][field] = readValue(input);
      }
    } else if (type === "script") {
      body.code = script.querySelector("#f-code").value;
      body.command = splitCommand(script.querySelector("#f-command").value);
      const input = script.querySelector("#f-inputs-data").value;
      if (input) body.inputs = { data: input };
      const launchInput = script.querySelector("#f-distribution-launch");
      if (launchInput) body.distribution = { launch: launchInput.value };
      body.resources = {};
      for (const el of script.querySelectorAll("[name^='script.resources.']")) body.resources[el.name.split(".").pop()] = readValue(el);
    } else {
      body.model = evaluate.querySelector("#f-model").value;
      body.dataset = evaluate.querySelector("#f-dataset").value;
      body.batch_size = readValue(evaluate.querySelector("#f-batch_size"));
    }
    return body;
  };
  // A 422's field (resources.node_count) as this form names it: a script's resources are
  // script.resources.*.
  const boxOf = (type, field) => {
    const name = type === "script" && field.startsWith("resources.") ? `script.${field}` : field;
    return form.querySelector(`.field[data-field="${CSS.escape(name)}"]`);
  };

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    for (const el of form.querySelectorAll(".field-error")) el.textContent = "";
    for (const el of form.querySelectorAll(".field.invalid")) el.classList.remove("invalid");
    summary.replaceChildren();
    const type = typeSelect.value;
    try {
      const job = await api("/v1/jobs", { method: "POST", json: jsonWithIntegers(bodyOf(type)) });
      location.hash = `#/jobs/${job.id}`;
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      const unplaced = [];
      for (const { field, message } of err.fieldErrors()) {
        const box = boxOf(type, field);
        if (box) {
          box.classList.add("invalid");
          const slot = box.querySelector(".field-error");
          slot.textContent = slot.textContent ? `${slot.textContent}; ${message}` : message;
        } else unplaced.push(`${field}: ${message}`);
      }
      if (unplaced.length || !err.fieldErrors().length) summary.replaceChildren(errorBox(err));
    }
  });
  ctx.main.replaceChildren(h("h1", {}, "New job"), form);
}
