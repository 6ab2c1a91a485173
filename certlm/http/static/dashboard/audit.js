// "History": the audit trail records of the device the detail shows (GET /audit?device=ENTRY_ID), newest first:
// when, who, what, the outcome and the fields changed. Its own script beside dashboard.js, whose helpers it uses
// (api, el, timeElement, keyMay, state); it follows the detail by watching its data-url, so dashboard.js needs no
// call. A key whose role may not read the trail (viewer) is told so instead.
"use strict";

const HISTORY_SHOWN = 25;
const HISTORY_PAGE = 1000;

function historyBlock() {
  let block = document.getElementById("device-history");
  if (!block) {
    block = el(
      "div",
      { id: "device-history" },
      el("h3", {}, "History"),
      el("p", { id: "device-history-note", className: "muted small" }),
      el(
        "table",
        { id: "device-history-table" },
        el("thead", {}, el("tr", {}, ["When", "Who", "What", "Outcome", "Changed"].map((name) => el("th", { scope: "col" }, name)))),
        el("tbody", { id: "device-history-rows" }),
      ),
    );
    $("detail").append(block);
  }
  return block;
}

function shortValue(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "object") return value.sha256 ? `sha256 ${value.sha256.slice(0, 12)}…` : JSON.stringify(value);
  return String(value);
}

function changedFields(changes) {
  const lines = [];
  for (const change of changes || []) {
    if (change.op === "update") {
      for (const [name, after] of Object.entries(change.after || {})) {
        lines.push(`${name}: ${shortValue((change.before || {})[name])} → ${shortValue(after)}`);
      }
    } else if (change.op) {
      lines.push(`${change.table} ${change.op === "create" ? "created" : "deleted"}`);
    }
  }
  return lines.length ? el("ul", { className: "history-changes" }, lines.map((line) => el("li", {}, line))) : "–";
}

async function showHistory(url) {
  const block = historyBlock();
  const rows = $("device-history-rows");
  const note = $("device-history-note");
  rows.replaceChildren();
  const device = state.byUrl.get(url);
  if (!device) return;
  if (typeof keyMay === "function" && state.identity && !keyMay("operator")) {
    note.textContent = "The audit trail is for operators and administrators.";
    return;
  }
  note.textContent = "Loading…";
  const query = encodeURIComponent(device.entry && device.entry.id ? String(device.entry.id) : url);
  try {
    const records = [];
    let after = 0;
    for (;;) {
      const page = await api(`/audit?device=${query}&limit=${HISTORY_PAGE}&after_id=${after}`);
      records.push(...page.records);
      if (page.next_after_id === null) break;
      after = page.next_after_id;
    }
    if (state.selectedUrl !== url) return;
    const newest = records.slice(-HISTORY_SHOWN).reverse();
    note.textContent = records.length
      ? `The last ${newest.length} of ${records.length} records about this device.`
      : "No records about this device.";
    rows.replaceChildren(
      ...newest.map((record) =>
        el(
          "tr",
          { "data-id": record.id },
          el("td", {}, timeElement(record.at)),
          el("td", {}, record.actor, record.source ? el("span", { className: "muted small" }, ` from ${record.source}`) : null),
          el("td", {}, record.action, record.detail ? el("div", { className: "muted small" }, record.detail) : null),
          el("td", {}, statusBadge(record.outcome, record.outcome === "ok" ? "ok" : "bad"), record.status ? ` ${record.status}` : ""),
          el("td", {}, changedFields(record.changes)),
        ),
      ),
    );
  } catch (failure) {
    if (failure.status !== 401) note.textContent = `Could not read the history: ${failure.message}`;
  }
  block.hidden = false;
}

document.addEventListener("DOMContentLoaded", () => {
  const detail = document.getElementById("detail");
  if (!detail) return;
  new MutationObserver(() => {
    if (!detail.hidden && detail.dataset.url) showHistory(detail.dataset.url);
  }).observe(detail, { attributes: true, attributeFilter: ["data-url", "hidden"] });
});
