// Datasets: the list with class counts, and an archive upload with a progress bar.

import { api, upload } from "./api.js";
import { h, bytes, when, errorBox } from "./dom.js";

function classCounts(d) {
  const max = Math.max(1, ...Object.values(d.class_counts));
  return h(
    "table",
    { class: "class-counts" },
    h(
      "tbody",
      {},
      ...Object.entries(d.class_counts).map(([label, n]) => {
        const bar = h("span", { class: "bar" });
        bar.style.width = `${Math.round((n / max) * 100)}%`;
        return h("tr", {}, h("td", {}, label), h("td", { class: "num" }, n), h("td", { class: "bar-cell" }, bar));
      }),
    ),
  );
}

function row(d, reload, problem) {
  return h(
    "tr",
    { class: "dataset-row", dataset: { datasetId: d.id } },
    h("td", {}, d.name),
    h("td", { class: "num" }, d.num_images),
    h("td", {}, h("details", {}, h("summary", {}, `${d.classes.length} classes`), classCounts(d))),
    h("td", { class: "num" }, bytes(d.size_bytes)),
    h("td", {}, when(d.created_at)),
    h("td", { class: "mono small" }, d.id.slice(0, 8)),
    h(
      "td",
      {},
      h(
        "button",
        {
          class: "link-button",
          onclick: async () => {
            if (!confirm(`Delete dataset ${d.name}?`)) return;
            try {
              await api(`/v1/datasets/${d.id}`, { method: "DELETE" });
              reload();
            } catch (err) {
              problem.replaceChildren(errorBox(err));
            }
          },
        },
        "Delete",
      ),
    ),
  );
}

export async function renderDatasets(ctx) {
  const body = h("tbody", { id: "datasets-body" });
  const problem = h("div", { id: "datasets-error" });
  const reload = async () => {
    const page = await api("/v1/datasets?limit=200");
    body.replaceChildren(...page.items.map((d) => row(d, reload, problem)));
  };
  const name = h("input", { id: "upload-name", name: "name", required: true, placeholder: "name" });
  const file = h("input", { id: "upload-file", name: "file", type: "file", accept: ".zip,.tar,.tar.gz,.tgz", required: true });
  const bar = h("progress", { id: "upload-progress", max: "1", value: "0", hidden: true });
  const note = h("span", { id: "upload-note", class: "hint" });
  const form = h(
    "form",
    {
      id: "upload-form",
      class: "card inline-form",
      onsubmit: async (e) => {
        e.preventDefault();
        problem.replaceChildren();
        if (!file.files.length) {
          note.textContent = "choose an archive";
          return;
        }
        const data = new FormData();
        data.append("name", name.value || file.files[0].name.replace(/\.(zip|tar|tar\.gz|tgz)$/, ""));
        data.append("file", file.files[0]);
        bar.hidden = false;
        bar.value = 0;
        note.textContent = "uploading…";
        try {
          const d = await upload("/v1/datasets", data, (loaded, total) => {
            bar.value = loaded / total;
            note.textContent = loaded < total ? `${bytes(loaded)} of ${bytes(total)}` : "checking the images…";
          });
          form.reset();
          await reload();
          // Said once the list shows the new dataset.
          note.textContent = `uploaded ${d.name}: ${d.num_images} images in ${d.classes.length} classes`;
        } catch (err) {
          note.textContent = "";
          problem.replaceChildren(errorBox(err));
        } finally {
          bar.hidden = true;
        }
      },
    },
    h("strong", {}, "Upload a folder archive"),
    name,
    file,
    h("button", { type: "submit", id: "upload-submit" }, "Upload"),
    bar,
    note,
  );
  ctx.main.replaceChildren(
    h("h1", {}, "Datasets"),
    h("p", { class: "hint" }, "One sub-folder per class, images inside, as .zip, .tar or .tar.gz."),
    form,
    problem,
    h(
      "table",
      { class: "table", id: "datasets-table" },
      h("thead", {}, h("tr", {}, ...["Name", "Images", "Classes", "Size", "Created", "Id", ""].map((t) => h("th", {}, t)))),
      body,
    ),
  );
  await reload();
}
