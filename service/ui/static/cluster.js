// The cluster: nodes, their units and free units, running attempts, and drain/undrain
// (admins, where the service has those routes).

import { api } from "./api.js";
import { h, badge, duration, errorBox } from "./dom.js";

export async function renderCluster(ctx) {
  const summary = h("p", { id: "cluster-summary" });
  const body = h("tbody", { id: "nodes-body" });
  const problem = h("div", { id: "cluster-error" });
  const admin = ctx.me.role === "admin";
  const nodeAction = async (node, template) => {
    try {
      problem.replaceChildren();
      await api(template.replace(/\{[^}]+\}/, encodeURIComponent(node.name)), { method: "POST" });
      await load();
    } catch (err) {
      problem.replaceChildren(errorBox(err));
    }
  };
  const load = async () => {
    const c = await api("/v1/cluster");
    summary.textContent =
      `${c.ready_nodes} ready node(s), ${c.lost_nodes} lost; ${c.free_units} of ${c.total_units} units free; ` +
      `jobs may ask for up to ${c.max_nodes} node(s) and ${c.max_units_per_node} process(es) per node`;
    body.replaceChildren(
      ...c.nodes.map((n) => {
        const draining = n.status === "draining" || n.status === "drained";
        let control = "";
        if (admin && !draining && ctx.features.drainPath && n.status === "ready") {
          control = h(
            "button",
            {
              class: "drain",
              onclick: () => {
                if (confirm(`Drain node ${n.name}? It takes no new work, and its running jobs are checkpointed and placed elsewhere.`))
                  nodeAction(n, ctx.features.drainPath);
              },
            },
            "Drain",
          );
        } else if (admin && draining && ctx.features.undrainPath) {
          control = h("button", { class: "undrain", onclick: () => nodeAction(n, ctx.features.undrainPath) }, "Undrain");
        }
        const attempts = (n.attempts || []).map((a) =>
          a.job_id ? h("a", { href: `#/jobs/${a.job_id}` }, `${a.job_id.slice(0, 8)} #${a.attempt_number}`) : `attempt ${a.attempt_number}`,
        );
        return h(
          "tr",
          { class: "node-row", dataset: { node: n.name } },
          h("td", {}, n.name),
          h("td", {}, badge(n.status)),
          h("td", {}, n.accelerator),
          h("td", { class: "num" }, n.units),
          h("td", { class: "num" }, n.free_units),
          h("td", {}, attempts.length ? attempts.flatMap((a, i) => (i ? [", ", a] : [a])) : "none"),
          h("td", {}, `${duration(n.seconds_since_heartbeat)} ago`),
          h("td", { class: "mono small" }, n.address),
          h("td", {}, control),
        );
      }),
    );
  };
  ctx.main.replaceChildren(
    h("h1", {}, "Cluster"),
    summary,
    problem,
    h(
      "table",
      { class: "table", id: "nodes-table" },
      h("thead", {}, h("tr", {}, ...["Node", "Status", "Accelerator", "Units", "Free", "Running attempts", "Heartbeat", "Address", ""].map((t) => h("th", {}, t)))),
      body,
    ),
  );
  await load();
  const timer = setInterval(() => load().catch(() => {}), 5000);
  ctx.onLeave(() => clearInterval(timer));
}
