// The web app: sign-in, navigation and a router over #/... fragments. Each page is a
// module whose render(ctx) fills ctx.main and registers what to stop on leaving.

import { api, ApiError } from "./api.js";
import { h, errorBox } from "./dom.js";
import { renderJobs } from "./jobs.js";
import { renderJob } from "./job.js";
import { renderNewJob } from "./newjob.js";
import { renderDatasets } from "./datasets.js";
import { renderModels } from "./models.js";
import { renderCluster } from "./cluster.js";
import { renderCompare } from "./compare.js";
import { renderSweeps, renderSweep } from "./sweeps.js";
import { renderTeams, renderQueue } from "./teams.js";

const state = { me: null, features: null, cleanups: [] };

// What this service offers, from its OpenAPI schema: pages and buttons for routes that
// are not there (an older service) stay hidden.
async function loadFeatures() {
  let paths = {};
  try {
    const schema = await api("/openapi.json");
    paths = schema.paths || {};
    state.schema = schema;
  } catch {
    state.schema = { components: { schemas: {} } };
  }
  return {
    models: "/v1/models" in paths,
    sweeps: "/v1/sweeps" in paths,
    teams: "/v1/teams/{name}/usage" in paths,
    predict: "/v1/models/{name}/versions/{version}/predict" in paths,
    outputs: "/v1/jobs/{job_id}/outputs" in paths,
    drain: "/v1/cluster/nodes/{node_id}/drain" in paths || Object.keys(paths).some((p) => p.endsWith("/drain")),
    drainPath: Object.keys(paths).find((p) => p.startsWith("/v1/cluster/nodes/") && p.endsWith("/drain")),
    undrainPath: Object.keys(paths).find((p) => p.startsWith("/v1/cluster/nodes/") && p.endsWith("/undrain")),
  };
}

function cleanup() {
  for (const fn of state.cleanups.splice(0)) {
    try {
      fn();
    } catch {
      // a page's stopper failing must not keep the next page from showing
    }
  }
}

function nav() {
  const link = (href, text, id) => h("a", { href, id, class: "nav-link" }, text);
  const links = [link("#/jobs", "Jobs", "nav-jobs"), link("#/jobs/new", "New job", "nav-new")];
  links.push(link("#/datasets", "Datasets", "nav-datasets"));
  if (state.features.sweeps) links.push(link("#/sweeps", "Sweeps", "nav-sweeps"));
  if (state.features.models) links.push(link("#/models", "Models", "nav-models"));
  if (state.features.teams) {
    links.push(link("#/teams", "Teams", "nav-teams"));
    links.push(link("#/queue", "Queue", "nav-queue"));
  }
  links.push(link("#/cluster", "Cluster", "nav-cluster"));
  return h(
    "nav",
    { class: "topnav" },
    h("a", { href: "#/jobs", class: "brand" }, "torchyard"),
    ...links,
    h("span", { class: "spacer" }),
    h("span", { class: "who", id: "whoami" }, `${state.me.email || state.me.name} (${state.me.role})`),
    h("button", { id: "sign-out", class: "link-button", onclick: signOut }, "Sign out"),
  );
}

async function signOut() {
  try {
    await api("/v1/session", { method: "DELETE" });
  } finally {
    state.me = null;
    location.hash = "#/signin";
    route();
  }
}

function renderSignIn(root, problem) {
  const input = h("input", {
    id: "token",
    name: "token",
    type: "password",
    autocomplete: "current-password",
    placeholder: "API token",
    required: true,
  });
  const message = h("div", { id: "signin-error", class: "field-error" }, problem || "");
  const form = h(
    "form",
    {
      id: "signin-form",
      class: "signin card",
      onsubmit: async (e) => {
        e.preventDefault();
        message.textContent = "";
        try {
          state.me = await api("/v1/session", { method: "POST", json: { token: input.value } });
          input.value = "";
          location.hash = "#/jobs";
          route();
        } catch (err) {
          message.textContent = err.message;
        }
      },
    },
    h("h1", {}, "Sign in to torchyard"),
    h("label", { for: "token" }, "Token"),
    input,
    h("p", { class: "hint" }, "A user or admin token (the first admin token is in admin.token in the data directory)."),
    message,
    h("button", { type: "submit", id: "signin-submit" }, "Sign in"),
  );
  root.replaceChildren(form);
  input.focus();
  offerProviderSignIn(form);
}

// Where the service signs users in with an OpenID provider (docs/oidc.md): a link to it
// above the token form, which stays for installs and people without the provider.
async function offerProviderSignIn(form) {
  let config;
  try {
    config = await api("/auth/oidc/config");
  } catch {
    return;
  }
  if (!config.enabled || !form.isConnected) return;
  const link = h(
    "a",
    { id: "oidc-signin", class: "button", href: "/auth/oidc/login" },
    `Sign in with ${config.provider}`,
  );
  form.insertBefore(h("p", {}, link), form.children[1]);
}

async function route() {
  cleanup();
  const root = document.getElementById("app");
  // The schema is public: it is read while the session is checked, not after.
  const features = state.features ? null : loadFeatures();
  if (!state.me) {
    try {
      state.me = await api("/v1/whoami");
    } catch (err) {
      if (!(err instanceof ApiError) || err.status !== 401) {
        root.replaceChildren(errorBox(err));
        return;
      }
      renderSignIn(root);
      return;
    }
    if (state.me.role === "worker") {
      state.me = null;
      renderSignIn(root, "worker tokens cannot sign in");
      return;
    }
  }
  if (!state.features) state.features = await features;
  const hash = location.hash || "#/jobs";
  const [path, query] = hash.slice(1).split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const main = h("main", { id: "main" });
  root.replaceChildren(nav(), main);
  const ctx = {
    main,
    me: state.me,
    features: state.features,
    schema: state.schema,
    params: new URLSearchParams(query || ""),
    onLeave: (fn) => state.cleanups.push(fn),
  };
  for (const a of root.querySelectorAll(".nav-link")) {
    if (hash.startsWith(a.getAttribute("href")) && !(a.id === "nav-jobs" && parts[1] === "new")) {
      a.classList.add("active");
    }
  }
  try {
    if (parts[0] === "signin") {
      location.hash = "#/jobs";
      return;
    }
    if (parts.length === 0 || (parts[0] === "jobs" && parts.length === 1)) await renderJobs(ctx);
    else if (parts[0] === "jobs" && parts[1] === "new") await renderNewJob(ctx);
    else if (parts[0] === "jobs") await renderJob(ctx, parts[1]);
    else if (parts[0] === "datasets") await renderDatasets(ctx);
    else if (parts[0] === "models" && state.features.models) await renderModels(ctx, parts[1]);
    else if (parts[0] === "cluster") await renderCluster(ctx);
    else if (parts[0] === "teams" && state.features.teams) await renderTeams(ctx);
    else if (parts[0] === "queue" && state.features.teams) await renderQueue(ctx);
    else if (parts[0] === "compare") await renderCompare(ctx);
    else if (parts[0] === "sweeps" && parts.length === 1) await renderSweeps(ctx);
    else if (parts[0] === "sweeps") await renderSweep(ctx, parts[1]);
    else main.replaceChildren(h("h1", {}, "Not found"), h("p", {}, "No such page."));
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) {
      state.me = null;
      renderSignIn(root, "your session ended: sign in again");
      return;
    }
    main.replaceChildren(errorBox(err));
  }
}

window.addEventListener("hashchange", route);
route();
