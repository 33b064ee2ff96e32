// Models (where the service has the registry routes): names, versions with the top-1 of
// the job each came from, downloads (the model directory as .tar.gz, the ONNX export),
// deleting a version, and predicting the label of an image dropped on a version.

import { api } from "./api.js";
import { h, fill, when, errorBox, percent } from "./dom.js";

function downloads(name, v) {
  const q = (s) => encodeURIComponent(s);
  const links = [];
  // A training job's version is that job's model directory; a script job's sits in its outputs.
  if (!v.path) {
    links.push(h("a", { class: "button download-dir", id: `download-dir-${v.version}`, href: `/v1/jobs/${q(v.job_id)}/model`, download: "" }, "Download directory (.tar.gz)"));
  } else {
    links.push(h("a", { class: "button download-dir", id: `download-dir-${v.version}`, href: `/v1/jobs/${q(v.job_id)}/outputs`, download: "" }, "Download the job's outputs (.tar.gz)"));
  }
  if (v.onnx) {
    links.push(h("a", { class: "button download-onnx", id: `download-onnx-${v.version}`, href: `/v1/models/${q(name)}/versions/${q(v.version)}/onnx`, download: "" }, "Download ONNX"));
  }
  return links;
}

function deleteButton(name, v, out) {
  return h(
    "button",
    {
      class: "danger delete-version",
      id: `delete-version-${v.version}`,
      onclick: async () => {
        if (!confirm(`Delete ${name} version ${v.version}? Its number is not given again.`)) return;
        try {
          await api(`/v1/models/${encodeURIComponent(name)}/versions/${encodeURIComponent(v.version)}`, { method: "DELETE" });
        } catch (err) {
          out.replaceChildren(errorBox(err));
          return;
        }
        // The page again: the model's other versions, or the list when it was the last.
        const left = await api(`/v1/models/${encodeURIComponent(name)}`).catch(() => null);
        location.hash = left ? `#/models/${encodeURIComponent(name)}?deleted=${v.version}` : "#/models";
      },
    },
    "Delete",
  );
}

function predictZone(name, version) {
  const out = h("div", { class: "predictions", id: `predictions-${version}` });
  const input = h("input", { type: "file", accept: "image/*", multiple: true, hidden: true, id: `predict-file-${version}` });
  const zone = h("div", { class: "dropzone", id: `dropzone-${version}`, tabindex: "0" }, "Drop images here (or click) to predict");
  const send = async (files) => {
    if (!files.length) return;
    const form = new FormData();
    for (const f of files) form.append("files", f);
    out.replaceChildren(h("span", { class: "hint" }, "predicting…"));
    try {
      const r = await api(`/v1/models/${encodeURIComponent(name)}/versions/${encodeURIComponent(version)}/predict`, { method: "POST", form });
      out.replaceChildren(
        ...(r.predictions || []).map((p) =>
          h("div", { class: "prediction", dataset: { label: p.top.length ? p.top[0].label : "" } }, h("strong", {}, p.file), " ", p.top.map((t) => `${t.label} ${(t.probability * 100).toFixed(1)}%`).join(", ")),
        ),
      );
    } catch (err) {
      out.replaceChildren(errorBox(err));
    }
  };
  zone.addEventListener("click", () => input.click());
  input.addEventListener("change", () => send(Array.from(input.files)));
  zone.addEventListener("dragover", (e) => {
    e.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    send(Array.from(e.dataTransfer.files));
  });
  return h("div", {}, zone, input, out);
}

export async function renderModels(ctx, name) {
  if (!name) {
    const page = await api("/v1/models");
    const items = page.items || page.models || [];
    ctx.main.replaceChildren(
      h("h1", {}, "Models"),
      items.length
        ? h(
            "table",
            { class: "table", id: "models-table" },
            h("thead", {}, h("tr", {}, ...["Name", "Latest version", "Architecture", "Top-1", "Created"].map((t) => h("th", {}, t)))),
            h(
              "tbody",
              {},
              ...items.map((m) => {
                const versions = m.versions || [];
                const latest = versions.find((v) => v.version === m.latest_version) || versions[versions.length - 1] || {};
                return h(
                  "tr",
                  { class: "model-row", dataset: { model: m.name } },
                  h("td", {}, h("a", { href: `#/models/${encodeURIComponent(m.name)}` }, m.name)),
                  h("td", {}, m.latest_version ?? ""),
                  h("td", {}, latest.architecture || ""),
                  h("td", { class: "num top1" }, percent(latest.top1)),
                  h("td", {}, when(latest.created_at)),
                );
              }),
            ),
          )
        : h("p", { class: "hint" }, "No models yet: register one from a succeeded job's page."),
    );
    return;
  }
  let model;
  try {
    model = await api(`/v1/models/${encodeURIComponent(name)}`);
  } catch (err) {
    if (err.status !== 404) throw err;
    ctx.main.replaceChildren(h("h1", {}, `Model ${name}`), errorBox(err), h("a", { href: "#/models" }, "All models"));
    return;
  }
  // Newest version first.
  const versions = [...(model.versions || [])].reverse();
  const deleted = ctx.params.get("deleted");
  fill(
    ctx.main,
    h("h1", { id: "model-name" }, `Model ${name}`),
    deleted ? h("p", { id: "model-note", class: "hint" }, `Deleted version ${deleted}.`) : null,
    ...versions.map((v) => {
      const out = h("div", { class: "version-error" });
      return h(
        "section",
        { class: "card model-version", id: `version-${v.version}` },
        h(
          "div",
          { class: "page-head" },
          h("h2", {}, `Version ${v.version}`, v.version === model.latest_version ? " (latest)" : ""),
          typeof v.top1 === "number" ? h("span", { class: "badge top1", id: `top1-${v.version}` }, `top-1 ${percent(v.top1)}`) : null,
          h("span", { class: "spacer" }),
          ...downloads(name, v),
          deleteButton(name, v, out),
        ),
        out,
        h(
          "p",
          { class: "hint" },
          `${v.architecture} · ${v.image_size} px · ${v.classes.length} classes · from job `,
          h("a", { href: `#/jobs/${v.job_id}` }, String(v.job_id).slice(0, 8)),
          v.path ? ` (${v.path})` : "",
          ` · ${when(v.created_at)}`,
        ),
        h("p", { class: "classes small" }, `Classes: ${v.classes.join(", ")}`),
        !ctx.features.predict
          ? null
          : v.onnx
            ? predictZone(name, v.version)
            : h("p", { class: "hint" }, "This version has no ONNX export, so it cannot predict here."),
      );
    }),
  );
}
