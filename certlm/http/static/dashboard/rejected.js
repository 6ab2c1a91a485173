// "Waiting for approval": the client certificates devices rejected (GET /gds/rejected, what the monitor found), each
// with Approve (the device then trusts that certificate: POST /gds/rejected/{id}/approve) and Dismiss (hidden from
// this list: .../dismiss). Its own script beside dashboard.js, whose helpers it uses (api, el, timeElement, keyMay);
// dashboard.js calls loadRejected() after each refresh and forgetRejected() when the key is forgotten.
"use strict";

const REJECTED_PAGE = 200;

function forgetRejected() {
  $("rejected-rows").replaceChildren();
  $("rejected-error").hidden = true;
  $("rejected-none").hidden = true;
}

async function loadRejected() {
  const error = $("rejected-error");
  try {
    const waiting = [];
    let after = 0;
    for (;;) {
      const page = await api(`/gds/rejected?state=waiting&limit=${REJECTED_PAGE}&after_id=${after}`);
      waiting.push(...page.rejected);
      if (page.next_after_id === null) break;
      after = page.next_after_id;
    }
    error.hidden = true;
    renderRejected(waiting);
  } catch (failure) {
    if (failure.status !== 401) showError(error, `Could not list the rejected clients: ${failure.message}`);
  }
}

function renderRejected(waiting) {
  $("rejected-none").hidden = waiting.length > 0;
  $("rejected-rows").replaceChildren(
    ...waiting.map((item) =>
      el(
        "tr",
        { "data-rejected-id": item.id },
        el("td", null, item.device, item.device_deleted ? " (deleted)" : ""),
        el("td", null, item.subject),
        el("td", null, item.application_uri || "–"),
        el("td", null, item.issuer),
        el("td", null, timeElement(item.last_seen)),
        el(
          "td",
          { className: "actions" },
          rejectedButton("Approve", item, "approve", {}),
          rejectedButton("Dismiss", item, "dismiss", undefined),
        ),
      ),
    ),
  );
}

function rejectedButton(label, item, action, body) {
  const button = el("button", { type: "button", "data-needs-role": "operator", "data-action": action }, label);
  button.addEventListener("click", () => decideRejected(item, action, body, button));
  return button;
}

async function decideRejected(item, action, body, button) {
  const error = $("rejected-error");
  button.disabled = true;
  try {
    await api(`/gds/rejected/${item.id}/${action}`, { method: "POST", body });
    error.hidden = true;
  } catch (failure) {
    showError(error, `${action === "approve" ? "Approving" : "Dismissing"} ${item.subject} failed: ${failure.message}`);
  } finally {
    button.disabled = false;
  }
  await loadRejected();
}
