// Teams (docs/teams.md): each team's quotas and use of them, a chart of its units used
// against its nominal quota over the last day (GET /v1/teams/{name}/usage, a sample a
// minute), and who borrows from whom now; and the queue: the waiting jobs in the order of
// the next scheduling pass, with their team's use of its quota and why each waits. Admins
// see every team and job; others their own teams and their jobs.

import { api } from "./api.js";
import { h, fill } from "./dom.js";
import { LineChart } from "./chart.js";

const POOL = "default";
const DAY_MS = 24 * 3600 * 1000;

// "6/4 (+2)": units used of the nominal quota, and what is borrowed past it.
export function usageText(u) {
  if (!u) return "–";
  return `${u.used}/${u.nominal}` + (u.borrowed ? ` (+${u.borrowed})` : "");
}

function quotaText(q) {
  const parts = [`${q.pool}: ${q.nominal}`];
  parts.push(q.borrowing_limit === null ? "may borrow any" : `may borrow ${q.borrowing_limit}`);
  parts.push(q.lending_limit === null ? "lends all idle" : `lends at most ${q.lending_limit}`);
  return parts.join(", ");
}

// Who borrows from whom, per pool, as the CLI's `team list` says it: a borrower takes
// idle units; each lender's `lent` is what of its idle nominal quota borrowers hold now.
export function borrowingLines(teams) {
  const pools = new Map();
  for (const t of teams) {
    for (const u of t.usage || []) {
      if (!pools.has(u.pool)) pools.set(u.pool, { borrowers: [], lenders: [] });
      const p = pools.get(u.pool);
      if (u.borrowed) p.borrowers.push([t.name, u.borrowed]);
      if (u.lent) p.lenders.push([t.name, u.lent]);
    }
  }
  const lines = [];
  for (const [pool, { borrowers, lenders }] of [...pools].sort(([a], [b]) => a.localeCompare(b))) {
    if (!borrowers.length) continue;
    const where = pool === POOL ? "" : ` in pool ${pool}`;
    const owned = lenders.reduce((n, [, v]) => n + v, 0);
    const spare = borrowers.reduce((n, [, v]) => n + v, 0) - owned;
    const sources = lenders.map(([name, n]) => (lenders.length > 1 ? `${name} (${n})` : name));
    if (spare > 0) sources.push(sources.length ? `units no team owns (${spare})` : "units no team owns");
    for (const [name, n] of borrowers) lines.push(`${name} borrows ${n}${where} from ${sources.join(", ") || "nobody"}`);
  }
  return lines;
}

function summary(t) {
  const u = (t.usage || []).find((x) => x.pool === POOL);
  const parts = [];
  if (u) {
    parts.push(`using ${u.used} of ${u.nominal}`);
    if (u.borrowed) parts.push(`borrowing ${u.borrowed}`);
    if (u.lent) parts.push(`lending ${u.lent}`);
  }
  parts.push(`weight ${t.weight}`);
  if (t.preempt_within) parts.push("higher priority preempts within the team");
  return parts.join(" · ");
}

export async function renderTeams(ctx) {
  const borrowing = h("div", { id: "borrowing", class: "card" });
  const list = h("div", { id: "teams-list" });
  const charts = new Map();
  ctx.onLeave(() => charts.forEach((c) => c.destroy()));
  ctx.main.replaceChildren(
    h("div", { class: "page-head" }, h("h1", {}, "Teams"), h("a", { href: "#/queue" }, "the queue")),
    borrowing,
    list,
  );

  const drawUsage = async (name) => {
    const since = new Date(Date.now() - DAY_MS).toISOString();
    const page = await api(`/v1/teams/${encodeURIComponent(name)}/usage?pool=${POOL}&since=${encodeURIComponent(since)}`);
    const now = Date.now();
    // x: hours before now (0 = now).
    const x = page.items.map((p) => (Date.parse(p.at) - now) / 3600e3);
    const chart = charts.get(name);
    chart.setData("used", x, page.items.map((p) => p.used));
    chart.setData("nominal", x, page.items.map((p) => p.nominal));
    chart.root.dataset.samples = String(page.items.length);
  };

  const load = async () => {
    const { items } = await api("/v1/teams");
    const lines = borrowingLines(items);
    fill(
      borrowing,
      h("h2", {}, "Borrowing now"),
      lines.length
        ? h("ul", { id: "borrowing-lines" }, ...lines.map((l) => h("li", { class: "borrow-line" }, l)))
        : h("p", { class: "hint", id: "borrowing-lines" }, "No team borrows now: every team is within its quota."),
    );
    if (!items.length) {
      fill(list, h("p", { class: "hint" }, "You are in no team."));
      return;
    }
    for (const t of items) {
      let card = list.querySelector(`.team-card[data-team="${CSS.escape(t.name)}"]`);
      if (!card) {
        card = h(
          "section",
          { class: "card team-card", dataset: { team: t.name } },
          h("h2", {}, t.name),
          h("p", { class: "team-summary" }),
          h("p", { class: "team-quotas small" }),
          h("p", { class: "team-members small" }),
          h("div", { class: "chart-box team-chart", id: `team-chart-${t.name}` }),
        );
        list.append(card);
        charts.set(
          t.name,
          new LineChart(card.querySelector(".team-chart"), {
            title: `${t.name}: units used and nominal quota, pool ${POOL}, last 24 h`,
            series: [
              { name: "used", label: "used" },
              { name: "nominal", label: "nominal" },
            ],
            xLabel: "hours from now",
            integerX: false,
          }),
        );
      }
      card.querySelector(".team-summary").textContent = summary(t);
      card.querySelector(".team-quotas").textContent = t.quotas.length
        ? `Quotas: ${t.quotas.map(quotaText).join("; ")}`
        : "No quota: its jobs wait in the one line, as without teams.";
      card.querySelector(".team-members").textContent = `Members: ${t.members.join(", ") || "none"}`;
    }
    await Promise.all(items.map((t) => drawUsage(t.name)));
  };
  await load();
  // The samples come once a minute.
  const timer = setInterval(() => load().catch(() => {}), 30000);
  ctx.onLeave(() => clearInterval(timer));
}

export async function renderQueue(ctx) {
  const body = h("tbody", { id: "queue-body" });
  const empty = h("p", { class: "hint", id: "queue-empty", hidden: true }, "No job is waiting.");
  ctx.main.replaceChildren(
    h("div", { class: "page-head" }, h("h1", {}, "Queue"), h("a", { href: "#/teams" }, "teams")),
    h("p", { class: "hint" }, "Waiting jobs in the order the next scheduling pass considers them."),
    h(
      "table",
      { class: "table", id: "queue-table" },
      h("thead", {}, h("tr", {}, ...["#", "Job", "Team", "Priority", "Units", "Team usage", "Why it waits"].map((t) => h("th", {}, t)))),
      body,
    ),
    empty,
  );
  const load = async () => {
    const { items } = await api("/v1/queue");
    empty.hidden = items.length > 0;
    body.replaceChildren(
      ...items.map((q) =>
        h(
          "tr",
          { class: "queue-row", dataset: { job: q.id } },
          h("td", { class: "num" }, q.position),
          h("td", {}, h("a", { href: `#/jobs/${q.id}` }, q.name), h("span", { class: "small mono inline" }, q.id.slice(0, 8))),
          h("td", {}, q.team || "–"),
          h("td", { class: "num" }, q.priority),
          h("td", { class: "num" }, q.units),
          h("td", { class: "num", title: q.usage ? `used/nominal (+borrowed) in pool ${q.usage.pool}` : "" }, usageText(q.usage)),
          h("td", { class: "small" }, q.reason || ""),
        ),
      ),
    );
  };
  await load();
  const timer = setInterval(() => load().catch(() => {}), 5000);
  ctx.onLeave(() => clearInterval(timer));
}
