// Models (where the service has the registry routes): names, versions, and predicting the
// label of an image dropped on a version.

import { api } from "./api.js";
import { h, when, errorBox } from "./dom.js";

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
            h("thead", {}, h("tr", {}, ...["Name", "Latest version", "Architecture", "Created"].map((t) => h("th", {}, t)))),
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
                  h("td", {}, when(latest.created_at)),
                );
              }),
            ),
          )
        : h("p", { class: "hint" }, "No models yet: register one from a succeeded job's page."),
    );
    return;
  }
  const model = await api(`/v1/models/${encodeURIComponent(name)}`);
  // Newest version first.
  const versions = [...(model.versions || [])].reverse();
  ctx.main.replaceChildren(
    h("h1", { id: "model-name" }, `Model ${name}`),
    ...versions.map((v) =>
      h(
        "section",
        { class: "card model-version", id: `version-${v.version}` },
        h("h2", {}, `Version ${v.version}`, v.version === model.latest_version ? " (latest)" : ""),
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
      ),
    ),
  );
}
