// certlm's dashboard: reads the REST API of the certlm that serves it, with the API key the operator typed in.
// Everything a device or certificate says is put on the page as text (textContent, never markup), and no request
// goes anywhere but this certlm (the page's Content-Security-Policy holds the browser to that as well).
"use strict";

const KEY_STORAGE = "certlm.apiKey";
const INVENTORY_PAGE = 1000;
const DAY_MS = 24 * 3600 * 1000;
const SVG_NS = "http://www.w3.org/2000/svg";

const state = {
  rows: [],
  byUrl: new Map(),
  system: null,
  license: null,
  pkiTypes: new Map(),
  pkiNames: new Map(),
  trustLists: null,
  sort: { key: "name", direction: 1 },
  page: 0,
  selectedUrl: null,
  campaigns: [],
  campaignId: null,
  campaign: null,
  campaignShown: null,
  campaignSelection: new Set(),
  identity: null,
  campaignTimer: null,
  campaignLoads: 0,
};

const $ = (id) => document.getElementById(id);

// ---- DOM helpers: text only ----------------------------------------------------------------------------------

function el(tag, attributes, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "className") node.className = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attributes, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function replaceChildren(node, ...children) {
  node.replaceChildren(...children.flat().filter((child) => child !== null && child !== undefined));
}

function showError(node, message) {
  node.textContent = message || "";
  node.hidden = !message;
}

// A status is always written out; its class only repeats it in colour.
function statusBadge(text, tone) {
  return el("span", { className: `status ${tone}` }, text);
}

// ---- times: the browser's time zone, the UTC value on hover ------------------------------------------------------

function parseTime(value) {
  if (!value) return null;
  // The inventory's "YYYY-MM-DD HH:MM:SS" is UTC.
  const text = /^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$/.test(value) ? `${value.replace(" ", "T")}Z` : value;
  const date = new Date(text);
  return Number.isNaN(date.getTime()) ? null : date;
}

const localFormat = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "short" });

function timeElement(value) {
  const date = value instanceof Date ? value : parseTime(value);
  if (!date) return document.createTextNode("–");
  const utc = date.toISOString().replace(/\.\d{3}Z$/, "Z");
  return el("time", { datetime: utc, title: `UTC ${utc}` }, localFormat.format(date));
}

// ---- the API ------------------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

async function api(path, { method = "GET", body } = {}) {
  const key = apiKey();
  const headers = { Accept: "application/json", "X-API-Key": key || "" };
  const options = { method, headers, credentials: "omit", cache: "no-store", referrerPolicy: "no-referrer" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, options);
  } catch (error) {
    throw new ApiError(0, `certlm did not answer: ${error.message}`);
  }
  let data = null;
  try {
    data = await response.json();
  } catch (error) {
    data = null;
  }
  if (response.status === 401) {
    // Only a refusal of the key still kept counts: calls started together answer one after the other, and one sent
    // after the key was dropped (or before another was entered) must not replace the reason shown.
    if (key && key === apiKey()) keyRefused(data && data.error);
    throw new ApiError(401, (data && data.error) || "wrong key");
  }
  if (!response.ok) {
    const message = data && typeof data.error === "string" ? data.error : `HTTP ${response.status}`;
    throw new ApiError(response.status, message);
  }
  return data;
}

function hostPath(url) {
  return encodeURIComponent(url);
}

// ---- the key ------------------------------------------------------------------------------------------------

function showKeyPrompt(message) {
  $("dashboard").hidden = true;
  $("session-actions").hidden = true;
  $("key-prompt").hidden = false;
  showError($("key-error"), message);
  $("api-key").value = "";
  $("api-key").focus();
}

function keyRefused(reason) {
  sessionStorage.removeItem(KEY_STORAGE);
  forgetData();
  showKeyPrompt(`Wrong key: certlm refused it (${reason || "invalid API key"}).`);
}

function forgetData() {
  forgetIdentity();
  state.rows = [];
  state.byUrl = new Map();
  state.trustLists = null;
  state.selectedUrl = null;
  replaceChildren($("device-rows"));
  $("detail").hidden = true;
  forgetCampaigns();
  forgetRejected(); // rejected.js
  resetLicensePanel();
  $("license-form").reset();
  $("license-result").hidden = true;
}

async function submitKey(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  try {
    // Needs the key but no license: a wrong key is told apart from a missing license.
    await loadIdentity();
  } catch (error) {
    if (error.status !== 401) showError($("key-error"), error.message);
    return;
  }
  $("api-key").value = "";
  await openDashboard();
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  forgetData();
  showKeyPrompt("The key is forgotten; enter it again to see the data.");
}

// ---- loading ------------------------------------------------------------------------------------------------

async function pages(path, key) {
  const items = [];
  let after = 0;
  for (;;) {
    const separator = path.includes("?") ? "&" : "?";
    if (key === "operations") {
      const page = await api(`${path}${separator}after_id=${after}`);
      items.push(...page.operations);
      if (page.next_after_id === null) return items;
      after = page.next_after_id;
    } else {
      const page = await api(`${path}${separator}limit=${INVENTORY_PAGE}&after_id=${after}`);
      items.push(...page);
      if (page.length < INVENTORY_PAGE) return items;
      after = page[page.length - 1].id;
    }
  }
}

// Which key this tab holds and its role (GET /apikeys/self): the page offers only what the role may do
// (dashboard.css hides every [data-needs-role] above it), and says so.
async function loadIdentity() {
  const self = await api("/apikeys/self");
  state.identity = self;
  document.body.dataset.role = self.role;
  const who = self.kind === "named_key" ? `key ‘${self.name}’` : "the service’s API key";
  const expires = self.expires ? `, expires ${localFormat.format(new Date(self.expires))}` : "";
  $("key-identity").textContent = `${who} · ${self.role}${expires}`;
  const note = $("role-note");
  note.hidden = self.role === "admin";
  note.textContent =
    self.role === "viewer"
      ? `Signed in with ${who}, role viewer: you can look at everything here; actions are hidden.`
      : `Signed in with ${who}, role ${self.role}: what needs the admin role (the license) is hidden.`;
  return self;
}

// Whether the key's role includes `role` ("viewer", "operator", "admin"): a part of the page that calls a route
// needing more than viewer asks this first (buttons only need data-needs-role="operator" in index.html).
function keyMay(role) {
  return Boolean(state.identity && state.identity.roles.includes(role));
}

function forgetIdentity() {
  state.identity = null;
  delete document.body.dataset.role;
  $("key-identity").textContent = "";
  $("role-note").hidden = true;
}

async function openDashboard() {
  $("key-prompt").hidden = true;
  $("dashboard").hidden = false;
  $("session-actions").hidden = false;
  if (!state.identity) {
    try {
      await loadIdentity();
    } catch (error) {
      if (error.status === 401) return;
      showError($("load-error"), `Could not tell the key's role: ${error.message}`);
    }
  }
  await refresh();
}

// The CA keys and device credentials exist only here: warn when no backup was taken, the last one failed, or it is
// older than CERTLM_BACKUP_WARN_AFTER_H (GET /systeminfo's last_backup.stale).
function renderBackupWarning(backup) {
  const warning = $("backup-warning");
  warning.hidden = !backup || !backup.stale;
  if (warning.hidden) return;
  if (!backup.time) {
    warning.textContent = backup.scheduled
      ? "No backup has been taken yet."
      : "No backup is scheduled: set CERTLM_BACKUP_SCHEDULE (README, Operating certlm) so that the CA keys and device credentials survive this machine.";
  } else if (!backup.ok) {
    warning.textContent = `The last backup (${localFormat.format(new Date(backup.time))}) failed: ${backup.error}`;
  } else {
    warning.textContent = `The last backup is older than ${backup.warn_after_h} hours: ${localFormat.format(new Date(backup.time))}.`;
  }
}

// A CA that expires soon takes every certificate it issued with it (GET /systeminfo's ca_rollover_proposals, made
// CERTLM_CA_ROLLOVER_WARNING_DAYS before): each one says what to do, until a campaign moves its devices away.
function renderRolloverWarnings(proposals) {
  const list = $("rollover-warnings");
  list.replaceChildren(
    ...(proposals || []).map((proposal) => {
      const item = document.createElement("li");
      item.textContent =
        `The CA of PKI entry ${proposal.pki_id} (${proposal.name || "unnamed"}) expires in ${proposal.days_left} ` +
        `day(s), on ${localFormat.format(new Date(proposal.expires))}; ${proposal.devices} device(s) depend on it. ` +
        `Make its successor and start a rollover campaign (POST /campaigns, kind ca-rollover, from_pki_id ${proposal.pki_id}).`;
      return item;
    }),
  );
  list.hidden = list.children.length === 0;
}

async function refresh() {
  showError($("load-error"), "");
  $("refresh").disabled = true;
  try {
    // The license first and on its own: it needs no license, so the License section works on an unlicensed service.
    state.license = await api("/systeminfo/lic").catch((error) => {
      if (error.status === 401) throw error;
      return { missing: error.message };
    });
    renderLicenseInstalled();
    const [entries, operations, system, pki, pkiTypes] = await Promise.all([
      pages("/inventory", "entries"),
      pages("/dashboard/operations", "operations"),
      api("/systeminfo"),
      api("/pki/inventory"),
      api("/pki"),
    ]);
    state.system = system;
    renderBackupWarning(system.last_backup);
    renderRolloverWarnings(system.ca_rollover_proposals);
    state.pkiTypes = new Map(pkiTypes.map((type) => [type.pki_type_id, type.pki_type]));
    state.pkiNames = new Map(pki.map((entry) => [entry.pki_id, entry.name]));
    state.trustLists = null;
    const lastById = new Map(operations.map((operation) => [operation.id, operation]));
    state.rows = entries.map((entry) => deviceRow(entry, lastById.get(entry.id), system));
    state.byUrl = new Map(state.rows.map((row) => [row.url, row]));
    renderOverview();
    renderTable();
    renderSchedulers(system, pki);
    $("refreshed").textContent = `updated ${localFormat.format(new Date())}`;
    if (state.selectedUrl && state.byUrl.has(state.selectedUrl)) await openDetail(state.selectedUrl, false);
  } catch (error) {
    const hint = error.status === 403 ? " — install a valid license in the License section below." : "";
    if (error.status !== 401) showError($("load-error"), `Could not load the data: ${error.message}${hint}`);
  } finally {
    $("refresh").disabled = false;
  }
  // On their own: the campaigns show even when another part of the page could not load.
  if (apiKey()) await loadCampaigns();
  if (apiKey()) await loadRejected(); // rejected.js
}

// ---- certificates: the serial and names from DER, for the table and trust lists ----------------------------------

function base64Bytes(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i += 1) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

function tlv(bytes, offset) {
  const tag = bytes[offset];
  let length = bytes[offset + 1];
  let header = 2;
  if (length & 0x80) {
    const count = length & 0x7f;
    length = 0;
    for (let i = 0; i < count; i += 1) length = length * 256 + bytes[offset + 2 + i];
    header += count;
  }
  const start = offset + header;
  if (start + length > bytes.length) throw new Error("truncated DER");
  return { tag, start, end: start + length };
}

function children(bytes, node) {
  const items = [];
  for (let offset = node.start; offset < node.end; ) {
    const child = tlv(bytes, offset);
    items.push(child);
    offset = child.end;
  }
  return items;
}

// A serial as whole bytes, as OpenSSL and the API show it (083F71..., never 83F71...): DER's sign byte dropped only.
function hex(bytes, node) {
  let start = node.start;
  while (start < node.end - 1 && bytes[start] === 0) start += 1;
  return Array.from(bytes.subarray(start, node.end), (b) => b.toString(16).padStart(2, "0")).join("").toUpperCase();
}

const ATTRIBUTE_NAMES = { "2.5.4.3": "CN", "2.5.4.6": "C", "2.5.4.7": "L", "2.5.4.8": "ST", "2.5.4.10": "O", "2.5.4.11": "OU", "0.9.2342.19200300.100.1.25": "DC" };

function oid(bytes, node) {
  const first = bytes[node.start];
  const arcs = [Math.floor(first / 40), first % 40];
  let value = 0;
  for (let i = node.start + 1; i < node.end; i += 1) {
    value = value * 128 + (bytes[i] & 0x7f);
    if (!(bytes[i] & 0x80)) {
      arcs.push(value);
      value = 0;
    }
  }
  return arcs.join(".");
}

function stringValue(bytes, node) {
  const raw = bytes.subarray(node.start, node.end);
  if (node.tag === 0x1e) return new TextDecoder("utf-16be").decode(raw);
  if (node.tag === 0x0c) return new TextDecoder("utf-8").decode(raw);
  return Array.from(raw, (b) => String.fromCharCode(b)).join("");
}

function distinguishedName(bytes, node) {
  const parts = [];
  for (const set of children(bytes, node)) {
    for (const pair of children(bytes, set)) {
      const [type, value] = children(bytes, pair);
      const name = oid(bytes, type);
      parts.push(`${ATTRIBUTE_NAMES[name] || name}=${stringValue(bytes, value)}`);
    }
  }
  return parts.reverse().join(", ");
}

function derTime(bytes, node) {
  const text = stringValue(bytes, node);
  const full = node.tag === 0x17 ? `${Number(text.slice(0, 2)) < 50 ? "20" : "19"}${text}` : text;
  const m = /^(\d{4})(\d\d)(\d\d)(\d\d)(\d\d)(\d\d)/.exec(full);
  return m ? new Date(Date.UTC(+m[1], +m[2] - 1, +m[3], +m[4], +m[5], +m[6])) : null;
}

function certificateFacts(base64) {
  try {
    const bytes = base64Bytes(base64);
    const tbs = children(bytes, tlv(bytes, 0))[0];
    const fields = children(bytes, tbs);
    const i = fields[0].tag === 0xa0 ? 1 : 0;
    const validity = children(bytes, fields[i + 3]);
    return {
      serial: hex(bytes, fields[i]),
      issuer: distinguishedName(bytes, fields[i + 2]),
      notAfter: derTime(bytes, validity[1]),
      subject: distinguishedName(bytes, fields[i + 4]),
    };
  } catch (error) {
    return null;
  }
}

function crlFacts(base64) {
  try {
    const bytes = base64Bytes(base64);
    const tbs = children(bytes, tlv(bytes, 0))[0];
    const fields = children(bytes, tbs);
    const i = fields[0].tag === 0x02 ? 1 : 0;
    const next = fields[i + 3] && (fields[i + 3].tag === 0x17 || fields[i + 3].tag === 0x18) ? fields[i + 3] : null;
    return { issuer: distinguishedName(bytes, fields[i + 1]), nextUpdate: next ? derTime(bytes, next) : null };
  } catch (error) {
    return null;
  }
}

// ---- the fleet ----------------------------------------------------------------------------------------------

function deviceState(entry) {
  if (entry.device_status === 0) return "inactive";
  if (entry.device_status === 2) return "deleted";
  // A changed SSH host key or TLS certificate outranks everything else: it stays until an operator re-pins.
  if (entry.schedule && entry.schedule.identity_changed_at) return "identity changed";
  if (entry.schedule && entry.schedule.unreachable_since) return "unreachable";
  return "active";
}

function revocationText(entry) {
  if (!entry.cert_base64) return "no certificate";
  if (entry.cert_revoked === true) return "revoked";
  if (entry.cert_revoked === false) return "not revoked";
  return "not checked";
}

function deviceRow(entry, lastOperation, system) {
  const facts = entry.cert_base64 ? certificateFacts(entry.cert_base64) : null;
  const validTo = parseTime(entry.cert_validto);
  const renewalDays = entry.renewal_days ?? system.gds_push_scheduler_renewal_days;
  const row = {
    entry,
    id: entry.id,
    name: entry.name || "",
    url: entry.url,
    service: entry.service || "",
    state: deviceState(entry),
    subject: entry.cert_subjectdn || "",
    issuer: entry.cert_issuerdn || "",
    serial: facts ? facts.serial : "",
    validTo,
    daysLeft: entry.cert_expdays,
    renewalDays,
    revocation: revocationText(entry),
    last: lastOperation || null,
    lastAt: lastOperation && lastOperation.at ? parseTime(lastOperation.at) : null,
  };
  row.bucket = expiryBucket(row);
  row.haystack = [row.name, row.url, row.service, row.subject, row.issuer, row.serial, row.state].join("\n").toLowerCase();
  return row;
}

function expiryBucket(row) {
  if (!row.validTo) return "none";
  if (row.validTo.getTime() <= Date.now()) return "expired";
  if (row.daysLeft < 7) return "week";
  if (row.daysLeft < row.renewalDays) return "renewal";
  return "later";
}

function renderOverview() {
  const rows = state.rows;
  const count = (predicate) => rows.filter(predicate).length;
  const active = new Set(["active", "unreachable", "identity changed"]);
  $("count-active").textContent = count((row) => active.has(row.state));
  $("count-unreachable").textContent = count((row) => row.state === "unreachable");
  $("count-identity-changed").textContent = count((row) => row.state === "identity changed");
  const listsInactive = state.system.show_inactive_devices;
  $("count-inactive").textContent = listsInactive ? count((row) => row.state === "inactive") : "not listed";
  $("inactive-note").hidden = listsInactive;
  $("inactive-note").textContent = "Inactive devices are left out of the inventory while show_inactive_devices is off.";
  $("count-revoked").textContent = count((row) => row.entry.cert_revoked === true);
  $("count-failed").textContent = count((row) => row.last && !row.last.success);
  renderExpiryChart(rows);

  const license = state.license;
  if (!license || license.missing) {
    $("license-endpoints").textContent = "no license";
    $("license-days").textContent = "–";
    $("license-note").textContent = license ? license.missing : "";
  } else {
    const used = license.licensed_endpoints_in_use ?? "?";
    $("license-endpoints").textContent = `${used} of ${license.licensed_endpoints ?? "?"}`;
    $("license-days").textContent = license.days_until_expiry ?? "–";
    const validity = license.validation_success ? "valid" : `not valid: ${license.validation_message || ""}`;
    $("license-note").textContent = `${license.license_type || ""} license for ${license.company || "?"}, ${validity}`;
  }
}

function renderExpiryChart(rows) {
  const renewalDays = state.system.gds_push_scheduler_renewal_days;
  const buckets = [
    ["expired", "Expired", "bar-expired"],
    ["week", "Under 7 days", "bar-week"],
    ["renewal", `Under renewal_days (${renewalDays})`, "bar-renewal"],
    ["later", "Later", "bar-later"],
    ["none", "No certificate", "bar-none"],
  ];
  const counts = Object.fromEntries(buckets.map(([key]) => [key, 0]));
  for (const row of rows) counts[row.bucket] += 1;
  const max = Math.max(1, ...Object.values(counts));
  const labelWidth = 230;
  const barWidth = 150;
  const rowHeight = 26;
  const chart = svg("svg", {
    viewBox: `0 0 ${labelWidth + barWidth + 60} ${buckets.length * rowHeight}`,
    role: "img",
    "aria-labelledby": "expiry-chart-title",
  });
  const summary = buckets.map(([key, label]) => `${label}: ${counts[key]}`).join("; ");
  chart.append(svg("title", { id: "expiry-chart-title" }, `Certificates by time left. ${summary}`));
  buckets.forEach(([key, label, className], index) => {
    const y = index * rowHeight;
    chart.append(svg("text", { x: 0, y: y + 17 }, label));
    const width = Math.round((counts[key] / max) * barWidth);
    chart.append(svg("rect", { x: labelWidth, y: y + 4, width: Math.max(width, 1), height: rowHeight - 8, class: className }));
    chart.append(svg("text", { x: labelWidth + Math.max(width, 1) + 6, y: y + 17, "data-bucket": key }, String(counts[key])));
  });
  replaceChildren($("expiry-chart"), chart);
}

// ---- the device table -------------------------------------------------------------------------------------------

function visibleRows() {
  const query = $("search").value.trim().toLowerCase();
  const wanted = $("state-filter").value;
  const { key, direction } = state.sort;
  return state.rows
    .filter((row) => (wanted === "all" || row.state === wanted) && (!query || row.haystack.includes(query)))
    .sort((a, b) => direction * compare(a[key], b[key]) || compare(a.url, b.url));
}

function compare(a, b) {
  const empty = (value) => value === null || value === undefined || value === "";
  if (empty(a) || empty(b)) return empty(a) - empty(b);
  if (a instanceof Date) return a.getTime() - b.getTime();
  if (typeof a === "number") return a - b;
  return String(a).localeCompare(String(b), undefined, { numeric: true, sensitivity: "base" });
}

function stateBadge(stateName) {
  const tone = { active: "ok", unreachable: "bad", "identity changed": "bad", inactive: "none", deleted: "none" }[stateName] || "none";
  return statusBadge(stateName, tone);
}

function daysBadge(row) {
  if (row.daysLeft === null || row.daysLeft === undefined) return "–";
  const tone = { expired: "bad", week: "bad", renewal: "warn", later: "ok" }[row.bucket] || "none";
  const text = row.bucket === "expired" ? `${row.daysLeft} (expired)` : String(row.daysLeft);
  return statusBadge(text, tone);
}

function revocationBadge(text) {
  return statusBadge(text, { revoked: "bad", "not revoked": "ok" }[text] || "none");
}

function lastOperationCell(last) {
  if (!last) return "none recorded";
  return el(
    "span",
    {},
    statusBadge(last.success ? "succeeded" : "failed", last.success ? "ok" : "bad"),
    " ",
    last.operation,
    last.trigger ? `, ${last.trigger}` : "",
    ", ",
    timeElement(last.at),
  );
}

function renderTable() {
  const rows = visibleRows();
  const size = Number($("page-size").value);
  const pageCount = Math.max(1, Math.ceil(rows.length / size));
  state.page = Math.min(state.page, pageCount - 1);
  const start = state.page * size;
  const shown = rows.slice(start, start + size);
  const body = shown.map((row) =>
    el(
      "tr",
      { "data-url": row.url, className: row.url === state.selectedUrl ? "selected" : null },
      el("td", { className: "name" }, el("button", { type: "button", className: "link", "data-open": row.url }, row.name || "(no name)")),
      el("td", { className: "url" }, row.url),
      el("td", { className: "service" }, row.service),
      el("td", { className: "state" }, stateBadge(row.state)),
      el("td", { className: "subject" }, row.subject || "–"),
      el("td", { className: "issuer" }, row.issuer || "–"),
      el("td", { className: "serial" }, row.serial || "–"),
      el("td", { className: "valid-to" }, timeElement(row.validTo)),
      el("td", { className: "num days-left" }, daysBadge(row)),
      el("td", { className: "revocation" }, revocationBadge(row.revocation)),
      el("td", { className: "last-operation" }, lastOperationCell(row.last)),
    ),
  );
  replaceChildren($("device-rows"), body);
  if (!rows.length) {
    $("device-rows").append(el("tr", {}, el("td", { colspan: 11 }, state.rows.length ? "No device matches." : "No devices in the inventory.")));
  }
  $("page-info").textContent = rows.length
    ? `Devices ${start + 1}–${start + shown.length} of ${rows.length}${rows.length !== state.rows.length ? ` (${state.rows.length} in all)` : ""}, page ${state.page + 1} of ${pageCount}`
    : `0 of ${state.rows.length} devices`;
  $("page-prev").disabled = state.page === 0;
  $("page-next").disabled = state.page >= pageCount - 1;
  for (const th of document.querySelectorAll("#device-table th[data-key]")) {
    if (th.dataset.key === state.sort.key) th.setAttribute("aria-sort", state.sort.direction > 0 ? "ascending" : "descending");
    else th.removeAttribute("aria-sort");
  }
}

function sortBy(key) {
  state.sort = { key, direction: state.sort.key === key ? -state.sort.direction : 1 };
  state.page = 0;
  renderTable();
}

// ---- one device -------------------------------------------------------------------------------------------------

function pairs(list, items) {
  replaceChildren(
    list,
    items.flatMap(([label, value]) => [el("dt", {}, label), el("dd", {}, value === null || value === undefined || value === "" ? "–" : value)]),
  );
}

async function openDetail(url, scroll = true) {
  const row = state.byUrl.get(url);
  if (!row) return;
  state.selectedUrl = url;
  for (const tr of document.querySelectorAll("#device-rows tr")) tr.classList.toggle("selected", tr.dataset.url === url);
  const section = $("detail");
  section.hidden = false;
  section.dataset.url = url;
  $("detail-heading").textContent = `Device ${row.name || "(no name)"} — ${url}`;
  showError($("detail-error"), "");
  if (scroll) section.scrollIntoView({ block: "start" });
  const path = hostPath(url);
  const optional = (promise) => promise.catch((error) => (error.status === 404 ? null : Promise.reject(error)));
  try {
    // The listing says which operation was last, so only that one is asked for (the other may well be 404).
    const last = row.last ? `/gds/push/${row.last.operation === "onboarding" ? "onboarding/" : ""}${path}` : null;
    const [detail, operation] = await Promise.all([
      optional(api(`/gds/inventory/crt/${path}`)),
      last ? optional(api(last)) : null,
    ]);
    if (state.selectedUrl !== url) return;
    renderCertificateDetail(detail, row);
    renderLastOperation(operation);
    await showStoredTrustList(url);
  } catch (error) {
    if (error.status !== 401) showError($("detail-error"), error.message);
  }
}

function renderCertificateDetail(detail, row) {
  const list = $("certificate-detail");
  if (!detail || !detail.certificate || !detail.certificate.subject_dn) {
    pairs(list, [["Certificate", "none stored for this device"], ...identityPairs(row.entry.schedule)]);
    return;
  }
  const c = detail.certificate;
  const revocation = detail.certificate_revocation || {};
  const reason = detail.certificate_revocation_reason;
  const san = Object.entries(c.san || {}).map(([type, names]) => `${type}: ${names.join(", ")}`).join("; ");
  pairs(list, [
    ["Name", detail.name || "(no name)"],
    ["Driver", row.service],
    ["Subject", c.subject_dn],
    ["Common name", c.subject_cn],
    ["Issuer", c.issuer_dn],
    ["Serial", el("span", { className: "detail-serial" }, c.serial_number || "–")],
    ["SHA-1", c.sha1_thumbprint],
    ["Valid from", timeElement(c.valid_from)],
    ["Valid to", timeElement(c.valid_to)],
    ["Days left", c.remaining_days],
    ["Key", c.key_type ? `${c.key_type} ${c.public_key_size || ""}`.trim() : null],
    ["Key usage", (c.key_usage || []).join(", ")],
    ["Extended key usage", (c.extended_key_usage || []).join(", ")],
    ["Alternative names", san],
    ["CRL distribution points", (c.cdp || []).join(", ")],
    ["Self-signed", c.self_signed ? "yes" : "no"],
    ["Revocation", revocation.name ? `${revocation.name}: ${revocation.description || ""}${reason ? ` (${reason.name || reason.id})` : ""}` : null],
    ["Certificate changed", timeElement(detail.last_changed_certificate_date)],
    ...identityPairs(row.entry.schedule),
  ]);
}

// The management channel's identity (SSH host key, TLS certificate) that no longer matches the pin, and why.
function identityPairs(schedule) {
  if (!schedule || !schedule.identity_changed_at) return [];
  return [
    ["Identity changed", el("span", { className: "identity-changed" }, timeElement(schedule.identity_changed_at))],
    ["Why", el("span", { className: "identity-changed-reason" }, schedule.identity_changed_reason || "")],
  ];
}

function stepRows(steps) {
  return (steps || []).map((step) =>
    el(
      "tr",
      {},
      el("td", {}, step.step),
      el("td", {}, statusBadge(step.ok ? "ok" : "failed", step.ok ? "ok" : "bad")),
      el("td", { className: "opcua-status" }, step.status || "–"),
      el("td", {}, step.message || ""),
    ),
  );
}

function renderLastOperation(record) {
  const body = $("operation-steps").querySelector("tbody");
  if (!record || !record.result) {
    replaceChildren($("operation-summary"), "No push or onboarding recorded for this device.");
    replaceChildren(body);
    return;
  }
  const result = record.result;
  replaceChildren(
    $("operation-summary"),
    statusBadge(record.success ? "succeeded" : "failed", record.success ? "ok" : "bad"),
    ` ${record.execution || ""}`,
    result.trigger ? ` — trigger: ${result.trigger}` : "",
    " — ",
    timeElement(result.at),
    record.error ? el("span", { className: "error-text" }, ` — ${record.error}`) : "",
  );
  replaceChildren(body, stepRows(result.steps));
}

async function showStoredTrustList(url) {
  if (state.trustLists === null) {
    const lists = await api("/gds/inventory/trustlist");
    state.trustLists = new Map(lists.map((list) => [list.url, list]));
  }
  if (state.selectedUrl !== url) return;
  renderTrustList(state.trustLists.get(url), "as last read and stored");
}

function renderTrustList(list, source) {
  $("trustlist-source").textContent = `(${source})`;
  const groups = [
    ["trustlist_trusted_ca", "Trusted certificates", "certificate"],
    ["trustlist_trusted_crl", "CRLs of trusted certificates", "crl"],
    ["trustlist_issuer_ca", "Issuer certificates", "certificate"],
    ["trustlist_issuer_crl", "CRLs of issuer certificates", "crl"],
  ];
  if (!list) {
    replaceChildren($("trustlist"), el("p", {}, "No trust list stored for this device."));
    return;
  }
  replaceChildren(
    $("trustlist"),
    groups.map(([key, label, kind]) => {
      const items = list[key] || [];
      return el(
        "div",
        { className: "trust-group" },
        el("h4", {}, `${label}: ${items.length}`),
        items.length
          ? el(
              "ul",
              { className: "plain" },
              items.map((item) => {
                if (kind === "certificate") {
                  const facts = certificateFacts(item);
                  return el("li", {}, facts ? `${facts.subject} (serial ${facts.serial}, valid to ` : "unreadable certificate", facts ? timeElement(facts.notAfter) : "", facts ? ")" : "");
                }
                const facts = crlFacts(item);
                return el("li", {}, facts ? `CRL of ${facts.issuer}, next update ` : "unreadable CRL", facts ? timeElement(facts.nextUpdate) : "");
              }),
            )
          : null,
      );
    }),
  );
}

// ---- schedulers, maintenance, PKI ---------------------------------------------------------------------------------

function renderSchedulers(system, pki) {
  for (const name of ["gds_push", "monitor"]) {
    const status = system[`${name}_scheduler_status`];
    const tone = { idle: "ok", running: "ok", suppressed: "warn", error: "bad" }[status] || "none";
    pairs($(`scheduler-${name}`).querySelector("dl"), [
      ["Status", statusBadge(status, tone)],
      ["Switched on", system[`${name}_scheduler_active`] ? "yes" : "no"],
      ["Last run", timeElement(system[`${name}_scheduler_last_run`])],
      ["Next run", timeElement(system[`${name}_scheduler_next_run`])],
      ["Every", `${system[`${name}_scheduler_scan_interval_sec`]} s`],
      ...(name === "gds_push" ? [["Renewal days", system.gds_push_scheduler_renewal_days]] : []),
      ["Detail", system[`${name}_scheduler_detail`]],
    ]);
  }
  const maintenance = system.maintenance_window;
  const paragraph = $("maintenance").querySelector("p");
  if (!maintenance) {
    replaceChildren(paragraph, "None active, none in the next 7 days.");
  } else if (maintenance.active) {
    replaceChildren(paragraph, statusBadge("active now", "warn"), ` ${maintenance.window_name} (id ${maintenance.window_id}) until `, timeElement(maintenance.ends_at), ": automated operations wait.");
  } else {
    replaceChildren(paragraph, statusBadge("next", "none"), ` ${maintenance.window_name} (id ${maintenance.window_id}) from `, timeElement(maintenance.starts_at), " until ", timeElement(maintenance.ends_at));
  }
  replaceChildren(
    $("pki").querySelector("ul"),
    pki.length
      ? pki.map((entry) =>
          el("li", {}, `${entry.name || "(no name)"} — id ${entry.pki_id}, type ${state.pkiTypes.get(entry.pki_type_id) || entry.pki_type_id}, ${entry.pki_connection}`),
        )
      : [el("li", {}, "No PKI endpoints configured.")],
  );
}

// ---- campaigns: followed while one runs, controlled with the API's own answers --------------------------------------

const CAMPAIGN_POLL_MS = 2000;
const CAMPAIGN_DEVICE_ROWS = 500;
const PHASES = ["trust", "reissue", "retire"];
const STEP_STATES = ["done", "pending", "failed", "unverified", "excepted", "skipped"];
const STEP_TONES = { done: "ok", pending: "none", failed: "bad", unverified: "warn", excepted: "warn", skipped: "none" };
// A device in one of these states keeps its phase open; failed and unverified ones block it until they get through.
const OPEN_STATES = new Set(["pending", "failed", "unverified"]);
const BLOCKING_STATES = new Set(["failed", "unverified"]);

function forgetCampaigns() {
  clearTimeout(state.campaignTimer);
  state.campaignTimer = null;
  state.campaignLoads += 1;
  state.campaigns = [];
  state.campaignId = null;
  state.campaign = null;
  state.campaignShown = null;
  state.campaignSelection.clear();
  replaceChildren($("campaign-rows"));
  replaceChildren($("campaign-device-rows"));
  $("campaign-detail").hidden = true;
  showError($("campaigns-error"), "");
  showError($("campaign-error"), "");
}

function campaignLive(campaign) {
  return campaign.state === "running" || campaign.state === "paused";
}

// The list and the open campaign, read again every CAMPAIGN_POLL_MS while a campaign runs (a paused, cancelled or
// finished one changes only when an operator acts, and this page reads it again after each action).
async function loadCampaigns() {
  const ticket = ++state.campaignLoads;
  clearTimeout(state.campaignTimer);
  state.campaignTimer = null;
  try {
    const openId = state.campaignId;
    const [list, open] = await Promise.all([api("/campaigns"), openId === null ? null : api(`/campaigns/${openId}`)]);
    if (ticket !== state.campaignLoads) return;
    showError($("campaigns-error"), "");
    state.campaigns = list;
    renderCampaigns();
    if (open && state.campaignId === openId) renderCampaign(open);
  } catch (error) {
    if (ticket !== state.campaignLoads || error.status === 401) return;
    showError($("campaigns-error"), `Could not load the campaigns: ${error.message}`);
  }
  if (ticket === state.campaignLoads && state.campaigns.some((campaign) => campaign.state === "running")) {
    state.campaignTimer = setTimeout(loadCampaigns, CAMPAIGN_POLL_MS);
  }
}

function campaignStateBadge(name) {
  return statusBadge(name, { running: "ok", paused: "warn", cancelled: "none", finished: "ok" }[name] || "none");
}

// "done 2, failed 1": how many devices of a phase are in each state.
function phaseCounts(counts) {
  const names = [...STEP_STATES, ...Object.keys(counts || {}).filter((name) => !STEP_STATES.includes(name))];
  const present = names.filter((name) => counts && counts[name]);
  if (!present.length) return "–";
  return present.flatMap((name, index) => [index ? ", " : "", el("span", { className: `count ${STEP_TONES[name] || "none"}` }, `${name} ${counts[name]}`)]);
}

// The API says whether a live campaign is past its deadline (overdue) and, for one campaign, whether its plan ends
// after it (deadline_outlook: "deadline at risk: ..."), in its own words.
function deadlineCell(campaign) {
  if (!campaign.deadline) return "none";
  const atRisk = !campaign.overdue && (campaign.deadline_outlook || "").startsWith("deadline at risk");
  return el(
    "span",
    {},
    timeElement(campaign.deadline),
    campaign.overdue ? [" ", statusBadge("overdue", "bad")] : null,
    atRisk ? [" ", statusBadge("at risk", "warn")] : null,
  );
}

function renderCampaigns() {
  const rows = state.campaigns.map((campaign) =>
    el(
      "tr",
      { "data-campaign-id": campaign.id, className: campaign.id === state.campaignId ? "selected" : null },
      el("td", { className: "campaign" }, el("button", { type: "button", className: "link", "data-campaign": campaign.id }, `Campaign ${campaign.id}`)),
      el("td", { className: "kind" }, campaign.kind),
      el("td", { className: "state" }, campaignStateBadge(campaign.state)),
      el("td", { className: "phase" }, campaign.phase),
      PHASES.map((phase) =>
        el("td", { className: `counts counts-${phase}${phase === campaign.phase ? " current" : ""}` }, phaseCounts(campaign.counts[phase])),
      ),
      el("td", { className: "deadline" }, deadlineCell(campaign)),
      el("td", { className: "blocked" }, campaign.blocked || "–"),
    ),
  );
  replaceChildren($("campaign-rows"), rows);
  if (!rows.length) $("campaign-rows").append(el("tr", {}, el("td", { colspan: 9 }, "No campaigns.")));
}

function campaignDeviceLabel(device) {
  const row = state.byUrl.get(device.url);
  return row && row.name ? `${row.name} (entry ${device.entry_id})` : `entry ${device.entry_id}`;
}

// Whether the device keeps a live campaign's current phase from its end: it failed or could not be verified there.
function blocking(campaign, device) {
  return campaignLive(campaign) && campaign.phase !== "done" && BLOCKING_STATES.has(device[campaign.phase]);
}

function lastStepCell(step) {
  if (!step) return "none yet";
  return el(
    "span",
    {},
    statusBadge(step.success ? "succeeded" : "failed", step.success ? "ok" : "bad"),
    ` ${step.phase || ""}, `,
    timeElement(step.at),
    step.error ? el("span", { className: "step-error" }, ` — ${step.error}`) : null,
  );
}

function exceptionsOpen(campaign) {
  return campaign.phase === "trust" && campaignLive(campaign);
}

// The CAs whose CRL the reissue waits for (the campaign's `crls_missing`): what the page offers to go on without
// (POST /campaigns/{id}/crl-waiver).
function crlsWaitedFor(campaign) {
  return exceptionsOpen(campaign) ? campaign.crls_missing || [] : [];
}

function renderCampaign(campaign) {
  const shown = JSON.stringify(campaign);
  state.campaign = campaign;
  state.campaignId = campaign.id;
  const section = $("campaign-detail");
  // A poll that brings nothing new leaves the page alone: no focus or scroll position lost.
  if (shown === state.campaignShown && !section.hidden) return;
  state.campaignShown = shown;
  section.hidden = false;
  section.dataset.campaignId = campaign.id;
  const pkiEntry = (id) => (state.pkiNames.get(id) ? `${id} (${state.pkiNames.get(id)})` : String(id));
  const issuers = campaign.kind === "rekey" ? `PKI entry ${pkiEntry(campaign.from_pki_id)}` : `PKI entry ${pkiEntry(campaign.from_pki_id)} to ${pkiEntry(campaign.to_pki_id)}`;
  $("campaign-detail-heading").textContent = `Campaign ${campaign.id}: ${campaign.kind}, ${issuers}`;

  const focused = document.activeElement;
  $("campaign-pause").hidden = campaign.state !== "running";
  $("campaign-resume").hidden = campaign.state !== "paused";
  $("campaign-cancel").hidden = !campaignLive(campaign);
  const devices = campaign.devices || [];
  const byEntry = new Map(devices.map((device) => [device.entry_id, device]));
  pairs($("campaign-facts"), [
    ["State", campaignStateBadge(campaign.state)],
    ["Phase", campaign.phase],
    ["Blocked by", campaign.blocked || "nothing"],
    ["Deadline", deadlineCell(campaign)],
    ["Deadline outlook", campaign.deadline_outlook || (campaign.deadline ? "holds" : "no deadline")],
    ["Window ahead", campaign.window_ahead || "none in the way"],
    ["Devices", devices.length],
    ["Devices at once", campaign.concurrency],
    ["Maintenance windows", campaign.respect_windows ? "respected" : "ignored"],
    ["Exceptions", campaign.exceptions.length ? campaign.exceptions.map((id) => (byEntry.has(id) ? campaignDeviceLabel(byEntry.get(id)) : `entry ${id}`)).join(", ") : "none"],
    ["CRLs waived", (campaign.crl_waivers || []).length ? campaign.crl_waivers.map((waiver) => waiver.subject).join(", ") : "none"],
    // The probe certificates certlm gave up revoking: the operator's to revoke at the PKI by hand.
    ["CRL probes left unrevoked", (campaign.crl_probe_unrevoked || []).length ? campaign.crl_probe_unrevoked.map((probe) => `serial ${probe.serial} at PKI entry ${pkiEntry(probe.pki_id)}: ${probe.error}`).join("; ") : "none"],
    ["Made", timeElement(campaign.created_at)],
    ["Changed", timeElement(campaign.updated_at)],
  ]);

  const excepting = exceptionsOpen(campaign);
  const selectable = new Set(excepting ? devices.filter((device) => OPEN_STATES.has(device.trust)).map((device) => device.entry_id) : []);
  for (const id of [...state.campaignSelection]) if (!selectable.has(id)) state.campaignSelection.delete(id);
  $("campaign-exceptions").hidden = !excepting;
  const waitedFor = crlsWaitedFor(campaign);
  $("campaign-crl-waiver").hidden = !waitedFor.length;
  // Each CA with why no CRL of it was had: the operator decides on the reason (a distribution point down for an hour
  // is waited out; a CA that publishes none is waived).
  replaceChildren(
    $("campaign-crl-cas"),
    waitedFor.map((ca) => el("li", { "data-sha1": ca.sha1 }, el("span", { className: "ca" }, ca.subject), ": ", el("span", { className: "problem" }, ca.problem))),
  );

  const focusedEntry = focused && focused.dataset ? focused.dataset.entry : undefined;
  const ordered = [...devices].sort((a, b) => blocking(campaign, b) - blocking(campaign, a) || a.entry_id - b.entry_id);
  const rows = ordered.slice(0, CAMPAIGN_DEVICE_ROWS).map((device) => {
    const blocks = blocking(campaign, device);
    return el(
      "tr",
      { "data-entry-id": device.entry_id, className: blocks ? "blocked" : null },
      el(
        "td",
        { className: "select" },
        selectable.has(device.entry_id)
          ? el("input", { type: "checkbox", "data-entry": device.entry_id, "aria-label": `Select ${device.url}`, checked: state.campaignSelection.has(device.entry_id) })
          : null,
      ),
      el("td", { className: "device" }, campaignDeviceLabel(device), blocks ? [" ", statusBadge("blocked", "bad")] : null),
      el("td", { className: "url" }, device.url),
      PHASES.map((phase) => el("td", { className: `step step-${phase}` }, statusBadge(device[phase], STEP_TONES[device[phase]] || "none"))),
      el("td", { className: "next-try" }, campaign.phase !== "done" && OPEN_STATES.has(device[campaign.phase]) && device.next_try_at ? timeElement(device.next_try_at) : "–"),
      el("td", { className: "last-step" }, lastStepCell(device.last_step)),
    );
  });
  replaceChildren($("campaign-device-rows"), rows);
  if (!rows.length) $("campaign-device-rows").append(el("tr", {}, el("td", { colspan: 8 }, "No devices.")));
  const note = $("campaign-devices-note");
  note.hidden = devices.length <= CAMPAIGN_DEVICE_ROWS;
  note.textContent = `Showing ${CAMPAIGN_DEVICE_ROWS} of ${devices.length} devices, the blocked ones first.`;
  if (focusedEntry !== undefined) {
    const again = $("campaign-device-rows").querySelector(`input[data-entry="${focusedEntry}"]`);
    if (again) again.focus();
  }
  showSelection();
}

function showSelection() {
  const count = state.campaignSelection.size;
  $("campaign-selected").textContent = count ? `${count} selected` : "none selected";
  $("campaign-accept").disabled = count === 0;
}

async function openCampaign(id) {
  if (id !== state.campaignId) state.campaignSelection.clear();
  state.campaignId = id;
  state.campaignShown = null;
  showError($("campaign-error"), "");
  renderCampaigns();
  $("campaign-detail").scrollIntoView({ block: "start" });
  await loadCampaigns();
}

function closeCampaign() {
  state.campaignId = null;
  state.campaign = null;
  state.campaignShown = null;
  state.campaignSelection.clear();
  $("campaign-detail").hidden = true;
  renderCampaigns();
}

// One operator action on the open campaign: its answer is shown at once, or the API's error as it says it.
async function campaignCall(call) {
  showError($("campaign-error"), "");
  const focused = document.activeElement;
  const buttons = document.querySelectorAll("#campaign-detail button");
  buttons.forEach((button) => {
    button.disabled = true;
  });
  try {
    const campaign = await call();
    if (campaign.id === state.campaignId) {
      state.campaignShown = null;
      renderCampaign(campaign);
    }
  } catch (error) {
    if (error.status === 401) return;
    showError($("campaign-error"), error.message);
  } finally {
    buttons.forEach((button) => {
      button.disabled = false;
    });
    showSelection();
    // The button pressed may be gone (Pause once paused): the keyboard goes on from the first action left.
    const target = focused && !focused.hidden && !focused.disabled ? focused : $("campaign-detail").querySelector(".campaign-actions button:not([hidden])");
    if (target && !$("campaign-detail").hidden) target.focus();
  }
  await loadCampaigns();
}

async function controlCampaign(action) {
  if (!keyMay("operator")) return; // not offered to this key's role (certlm would answer 403)
  const campaign = state.campaign;
  if (!campaign) return;
  if (action === "cancel") {
    const question =
      `Cancel campaign ${campaign.id} (${campaign.kind}, in its ${campaign.phase} phase)? It ends where it is and cannot be resumed. ` +
      "What it added to trust lists stays: the devices keep trusting both issuers, and later pushes keep it so, until the retire phase of another campaign removes the old issuer. " +
      "Devices already reissued keep their new certificates.";
    if (!(await confirmAction("Cancel the campaign", question))) return;
  }
  await campaignCall(() => api(`/campaigns/${campaign.id}/${action}`, { method: "POST" }));
}

function selectBlocked() {
  const campaign = state.campaign;
  if (!campaign || !exceptionsOpen(campaign)) return;
  for (const device of campaign.devices || []) {
    if (BLOCKING_STATES.has(device.trust)) state.campaignSelection.add(device.entry_id);
  }
  state.campaignShown = null;
  renderCampaign(campaign);
}

async function acceptExceptions() {
  if (!keyMay("operator")) return; // not offered to this key's role (certlm would answer 403)
  const campaign = state.campaign;
  const ids = [...state.campaignSelection].sort((a, b) => a - b);
  if (!campaign || !ids.length) return;
  const byEntry = new Map((campaign.devices || []).map((device) => [device.entry_id, device]));
  const named = ids.slice(0, 10).map((id) => (byEntry.has(id) ? `${campaignDeviceLabel(byEntry.get(id))} at ${byEntry.get(id).url}` : `entry ${id}`));
  const more = ids.length > 10 ? ` and ${ids.length - 10} more` : "";
  const question =
    `Go on without ${ids.length === 1 ? "this device" : `these ${ids.length} devices`} in campaign ${campaign.id}: ${named.join("; ")}${more}? ` +
    "The trust phase stops waiting for them and they are left out of the campaign: they keep their certificates and trust lists as they are, " +
    "and lose trust with their peers once those have certificates from the new issuer and no longer trust the old one. This cannot be undone in this campaign.";
  if (!(await confirmAction("Accept as exceptions", question))) return;
  await campaignCall(() => api(`/campaigns/${campaign.id}/exceptions`, { method: "POST", body: { entry_ids: ids } }));
}

async function waiveCrls() {
  if (!keyMay("operator")) return; // not offered to this key's role (certlm would answer 403)
  const campaign = state.campaign;
  const cas = campaign ? crlsWaitedFor(campaign) : [];
  if (!cas.length) return;
  const question =
    `Go on in campaign ${campaign.id} without the CRL of ${cas.map((ca) => `${ca.subject} (SHA-1 ${ca.sha1})`).join(", ")}? ` +
    "The reissue stops waiting for it. Devices that demand a CRL of every CA on a path will refuse their peers' new certificates of this CA; " +
    "devices that do not are unaffected. This cannot be undone in this campaign.";
  if (!(await confirmAction("Go on without the CRL", question))) return;
  await campaignCall(() => api(`/campaigns/${campaign.id}/crl-waiver`, { method: "POST", body: { cas: cas.map((ca) => ca.sha1) } }));
}

// ---- actions: confirmed, with the result's steps ----------------------------------------------------------------

function confirmAction(title, text) {
  const dialog = $("confirm-dialog");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "cancel";
    dialog.showModal();
    $("confirm-cancel").focus();
  });
}

function showResult(title, outcome) {
  $("result-title").textContent = title;
  const summary = $("result-summary");
  const body = $("result-steps").querySelector("tbody");
  if (outcome.error) {
    replaceChildren(summary, statusBadge("failed", "bad"), ` ${outcome.error}`);
    replaceChildren(body, stepRows(outcome.steps));
  } else {
    const data = outcome.data;
    const success = data.success !== false;
    replaceChildren(summary, statusBadge(success ? "succeeded" : "failed", success ? "ok" : "bad"), ` ${data.execution || outcome.text || ""}`, data.error ? ` — ${data.error}` : "");
    replaceChildren(body, stepRows(data.result ? data.result.steps : outcome.steps));
  }
  $("result-steps").hidden = !body.children.length;
  $("result-dialog").showModal();
}

async function runAction(title, call) {
  const buttons = document.querySelectorAll(".detail-actions button, #enroll-open");
  buttons.forEach((button) => {
    button.disabled = true;
  });
  try {
    const data = await call();
    return { data };
  } catch (error) {
    return { error: error.message, status: error.status };
  } finally {
    buttons.forEach((button) => {
      button.disabled = false;
    });
  }
}

async function renewNow() {
  if (!keyMay("operator")) return; // not offered to this key's role (certlm would answer 403)
  const row = state.byUrl.get(state.selectedUrl);
  if (!row) return;
  const label = row.name ? `${row.name} (${row.url})` : row.url;
  if (!(await confirmAction("Renew now", `Renew the certificate of ${label} now? certlm has the entry's PKI issue a new certificate and writes it into the device.`))) return;
  const outcome = await runAction("Renew now", () => api("/gds/push/change", { method: "POST", body: { server: row.entry.server, port: row.entry.port } }));
  if (outcome.status === 401) return;
  showResult(`Renew now: ${label}`, outcome);
  await refresh();
}

async function readNow() {
  if (!keyMay("operator")) return; // not offered to this key's role (certlm would answer 403)
  const row = state.byUrl.get(state.selectedUrl);
  if (!row) return;
  const label = row.name ? `${row.name} (${row.url})` : row.url;
  if (!(await confirmAction("Read the device now", `Connect to ${label} now, read its certificate, check its revocation and store what it reads?`))) return;
  const outcome = await runAction("Read now", () =>
    api("/gds/monitor/crt", { method: "POST", body: { server: row.entry.server, port: String(row.entry.port), fingerprint: "sha1" } }),
  );
  if (outcome.status === 401) return;
  if (outcome.data) {
    outcome.text = `read ${outcome.data.url || label}: certificate SHA-1 ${outcome.data.fingerprint || "?"}, stored in the inventory`;
    outcome.steps = [];
  }
  showResult(`Read now: ${label}`, outcome);
  await refresh();
}

async function readTrustListLive() {
  const url = state.selectedUrl;
  if (!url) return;
  showError($("detail-error"), "");
  try {
    const list = await api(`/gds/monitor/trustlist/${hostPath(url)}`);
    if (state.selectedUrl === url) renderTrustList(list, `read live ${localFormat.format(new Date())}`);
    state.trustLists = null;
  } catch (error) {
    if (error.status !== 401) showError($("detail-error"), `Reading the trust list failed: ${error.message}`);
  }
}

function openEnroll() {
  $("enroll-form").reset();
  $("enroll-dialog").showModal();
  $("enroll-server").focus();
}

async function submitEnroll(event) {
  event.preventDefault();
  if (!keyMay("operator")) return;
  const form = $("enroll-form");
  if (!form.reportValidity()) return;
  const value = (id) => $(id).value.trim();
  const body = { server: value("enroll-server"), port: Number(value("enroll-port")), issuer: $("enroll-issuer").checked, trusted: $("enroll-trusted").checked };
  for (const [field, id] of [["name", "enroll-name"], ["subject", "enroll-subject"], ["username", "enroll-username"]]) {
    if (value(id)) body[field] = value(id);
  }
  if ($("enroll-password").value) body.password = $("enroll-password").value;
  $("enroll-dialog").close();
  const target = `${body.server}:${body.port}`;
  if (!(await confirmAction("Enroll a new device", `Enroll ${target}${body.name ? ` as ${body.name}` : ""}? certlm registers it, has its PKI issue a certificate${body.subject ? ` for ${body.subject}` : ""} and writes it and the trust list into the device.`))) return;
  const outcome = await runAction("Enroll", () => api("/gds/push", { method: "POST", body }));
  $("enroll-password").value = "";
  if (outcome.status === 401) return;
  showResult(`Enroll ${target}`, outcome);
  await refresh();
}

// ---- the license: checked by a dry run, installed (or the previous one restored) once the operator confirms ----------

function licenseValidity(license) {
  if (!license.validity_start && !license.validity_end) return "–";
  return `${license.validity_start || "?"} to ${license.validity_end || "?"}`;
}

function licenseVerdict(license) {
  return license.validation_success
    ? statusBadge("valid", "ok")
    : el("span", {}, statusBadge("not valid", "bad"), ` ${license.validation_message || ""}`);
}

function licenseFacts(license) {
  return [
    ["Company", license.company],
    ["Type", license.license_type],
    ["Valid", licenseValidity(license)],
    ["Endpoints", license.licensed_endpoints],
    ["Features", (license.features || []).join(", ")],
    ["Validation", licenseVerdict(license)],
  ];
}

function renderLicenseInstalled() {
  const license = state.license;
  if (!license || license.missing) {
    pairs($("license-installed"), [
      ["License", statusBadge("none installed", "bad")],
      ["Effect", "Every feature-gated request answers 403 until a valid license is installed."],
    ]);
    return;
  }
  pairs($("license-installed"), [
    ...licenseFacts(license),
    ["Endpoints in use", license.licensed_endpoints_in_use],
    ["Days left", license.days_until_expiry],
  ]);
}

// What the dry run answered, and what the operator would confirm: {action: "install" | "restore", body, change}.
let pendingLicense = null;

function resetLicensePanel() {
  pendingLicense = null;
  $("license-preview").hidden = true;
  showError($("license-error"), "");
}

async function licenseText() {
  const file = $("license-file").files[0];
  const pasted = $("license-text").value.trim();
  if (file && pasted) throw new Error("Choose a license file or paste its text, not both.");
  if (file) return (await file.text()).trim();
  if (pasted) return pasted;
  throw new Error("Choose a license file or paste its text first.");
}

async function checkLicense(event) {
  event.preventDefault();
  if (!keyMay("admin")) return;
  resetLicensePanel();
  $("license-result").hidden = true;
  try {
    const body = { license_b64: await licenseText() };
    const change = await api("/systeminfo/lic?dry_run=true", { method: "POST", body });
    showLicensePreview({ action: "install", body, change });
  } catch (error) {
    if (error.status !== 401) showError($("license-error"), error.status ? `certlm refused the license: ${error.message}` : error.message);
  }
}

async function checkRestore() {
  if (!keyMay("admin")) return; // not offered to this key's role (certlm would answer 403)
  resetLicensePanel();
  $("license-result").hidden = true;
  try {
    const change = await api("/systeminfo/lic/restore?dry_run=true", { method: "POST" });
    showLicensePreview({ action: "restore", change });
  } catch (error) {
    if (error.status !== 401) showError($("license-error"), error.message);
  }
}

function showLicensePreview(pending) {
  pendingLicense = pending;
  const { action, change } = pending;
  const verb = action === "install" ? "Installing" : "Restoring";
  $("license-preview-title").textContent = `${verb} would put this license in force`;
  const replaced = change.replaced_license;
  pairs($("license-preview-fields"), [
    ...licenseFacts(change),
    ["Replaces", replaced ? replaced.description : "nothing: no license is installed now"],
  ]);
  const warning = $("license-warning");
  warning.hidden = change.service_licensed;
  warning.textContent = change.service_licensed
    ? ""
    : `This license is not valid: ${verb.toLowerCase()} it leaves the service unlicensed. Every feature-gated request, this page's data among them, answers 403 until a valid license is installed.${replaced ? ` The license in force now, ${replaced.description}, would be kept as the previous license and can be restored.` : ""}`;
  const noun = action === "install" ? "Install" : "Restore";
  $("license-apply").textContent = change.service_licensed ? `${noun} this license` : `${noun} anyway (unlicensed)`;
  $("license-apply").classList.toggle("primary", change.service_licensed);
  $("license-preview").hidden = false;
  $("license-apply").focus();
}

async function applyLicense() {
  if (!keyMay("admin")) return; // not offered to this key's role (certlm would answer 403)
  const pending = pendingLicense;
  if (!pending) return;
  const { action, body, change } = pending;
  const question = change.service_licensed
    ? `${action === "install" ? "Install" : "Restore"} ${change.description}?`
    : `${action === "install" ? "Install" : "Restore"} ${change.description}, which is not valid? The service will be unlicensed until a valid license is installed.`;
  if (!(await confirmAction(action === "install" ? "Install the license" : "Restore the previous license", question))) return;
  const path = action === "install" ? "/systeminfo/lic" : "/systeminfo/lic/restore";
  try {
    const result = await api(path, { method: "POST", body });
    resetLicensePanel();
    $("license-form").reset();
    const resultNode = $("license-result");
    replaceChildren(resultNode, statusBadge(result.service_licensed ? "licensed" : "unlicensed", result.service_licensed ? "ok" : "bad"), ` ${result.summary}`);
    resultNode.hidden = false;
  } catch (error) {
    if (error.status !== 401) showError($("license-error"), error.message);
    return;
  }
  await refresh();
}

// ---- wiring ---------------------------------------------------------------------------------------------------

function wire() {
  $("key-form").addEventListener("submit", submitKey);
  $("forget-key").addEventListener("click", forgetKey);
  $("refresh").addEventListener("click", refresh);
  $("search").addEventListener("input", () => {
    state.page = 0;
    renderTable();
  });
  $("state-filter").addEventListener("change", () => {
    state.page = 0;
    renderTable();
  });
  $("page-size").addEventListener("change", () => {
    state.page = 0;
    renderTable();
  });
  $("page-prev").addEventListener("click", () => {
    state.page -= 1;
    renderTable();
  });
  $("page-next").addEventListener("click", () => {
    state.page += 1;
    renderTable();
  });
  for (const th of document.querySelectorAll("#device-table th[data-key]")) {
    th.querySelector("button").addEventListener("click", () => sortBy(th.dataset.key));
  }
  $("device-rows").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-open]");
    if (button) openDetail(button.dataset.open);
  });
  $("detail-close").addEventListener("click", () => {
    state.selectedUrl = null;
    $("detail").hidden = true;
    renderTable();
  });
  $("renew-now").addEventListener("click", renewNow);
  $("read-now").addEventListener("click", readNow);
  $("read-trustlist").addEventListener("click", readTrustListLive);
  $("enroll-open").addEventListener("click", openEnroll);
  $("enroll-cancel").addEventListener("click", () => $("enroll-dialog").close());
  $("enroll-form").addEventListener("submit", submitEnroll);
  $("license-form").addEventListener("submit", checkLicense);
  $("license-restore-check").addEventListener("click", checkRestore);
  $("license-cancel").addEventListener("click", resetLicensePanel);
  $("license-apply").addEventListener("click", applyLicense);
  $("campaign-rows").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-campaign]");
    if (button) openCampaign(Number(button.dataset.campaign));
  });
  $("campaign-pause").addEventListener("click", () => controlCampaign("pause"));
  $("campaign-resume").addEventListener("click", () => controlCampaign("resume"));
  $("campaign-cancel").addEventListener("click", () => controlCampaign("cancel"));
  $("campaign-close").addEventListener("click", closeCampaign);
  $("campaign-select-blocked").addEventListener("click", selectBlocked);
  $("campaign-accept").addEventListener("click", acceptExceptions);
  $("campaign-waive-crl").addEventListener("click", waiveCrls);
  $("campaign-device-rows").addEventListener("change", (event) => {
    const box = event.target.closest("input[data-entry]");
    if (!box) return;
    const id = Number(box.dataset.entry);
    if (box.checked) state.campaignSelection.add(id);
    else state.campaignSelection.delete(id);
    showSelection();
  });
}

wire();
if (apiKey()) openDashboard();
else showKeyPrompt("");
