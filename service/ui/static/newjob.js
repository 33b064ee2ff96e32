// The new-job form: one input per field of the service's own JobCreate schema (so every
// parameter shows its range and default; the model's init_from_job and the job's priority
// too), dataset pickers, and each 422 next to its field.

import { api, ApiError, jsonWithIntegers } from "./api.js";
import { h, errorBox } from "./dom.js";

// Used when the schema cannot be read: the fields of SPEC §2.
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
  const choices = prop.enum || (prop.anyOf || []).find((t) => t.enum)?.enum;
  return { type, nullable, choices };
}

function rangeText(prop) {
  if (prop.allowed) return prop.allowed;
  const bits = [];
  if (prop.minimum !== undefined) bits.push(`>= ${prop.minimum}`);
  if (prop.exclusiveMinimum !== undefined) bits.push(`> ${prop.exclusiveMinimum}`);
  if (prop.maximum !== undefined) bits.push(`<= ${prop.maximum}`);
  return bits.join(" and ");
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
  const hint = [range ? `allowed: ${range}` : "", prop.default !== undefined ? `default: ${prop.default === null ? "none" : prop.default}` : ""]
    .filter(Boolean)
    .join("; ");
  return h(
    "div",
    { class: "field", dataset: { field: path } },
    h("label", { for: id }, path.split(".").pop()),
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

export async function renderNewJob(ctx) {
  const datasets = (await api("/v1/datasets?limit=200")).items;
  const spec = sections(ctx.schema);
  const summary = h("div", { id: "form-error" });
  const priority = fieldRow("priority", priorityProp(ctx.schema));
  const groups = Object.entries(spec).map(([section, fields]) =>
    h("fieldset", { class: "card" }, h("legend", {}, section), ...Object.entries(fields).map(([name, prop]) => fieldRow(`${section}.${name}`, prop))),
  );
  const form = h(
    "form",
    { id: "new-job-form", novalidate: true },
    h(
      "fieldset",
      { class: "card" },
      h("legend", {}, "job"),
      h("div", { class: "field", dataset: { field: "name" } }, h("label", { for: "f-name" }, "name"), h("input", { id: "f-name", name: "name", value: "" }), h("div", { class: "field-error", id: "err-f-name" })),
      datasetPicker("train_dataset", "training dataset", datasets),
      datasetPicker("validation_dataset", "validation dataset", datasets),
      priority,
    ),
    ...groups,
    summary,
    h("button", { type: "submit", id: "submit-job" }, "Submit job"),
  );
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    for (const el of form.querySelectorAll(".field-error")) el.textContent = "";
    for (const el of form.querySelectorAll(".field.invalid")) el.classList.remove("invalid");
    summary.replaceChildren();
    const body = { model: {}, parameters: {}, resources: {} };
    const name = form.querySelector("#f-name").value.trim();
    if (name) body.name = name;
    body.train_dataset = form.querySelector("#f-train_dataset").value;
    body.validation_dataset = form.querySelector("#f-validation_dataset").value;
    body.priority = readValue(form.querySelector("#f-priority"));
    for (const input of form.querySelectorAll("fieldset [name*='.']")) {
      const [section, field] = input.name.split(".");
      body[section][field] = readValue(input);
    }
    try {
      const job = await api("/v1/jobs", { method: "POST", json: jsonWithIntegers(body) });
      location.hash = `#/jobs/${job.id}`;
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      const unplaced = [];
      for (const { field, message } of err.fieldErrors()) {
        const box = form.querySelector(`.field[data-field="${CSS.escape(field)}"]`);
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
