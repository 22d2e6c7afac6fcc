// celery-lease web view: refresh the open page from its JSON endpoint, without a reload.
// Every value is written with textContent (never as HTML): row contents are user data.
(function () {
  "use strict";
  var body = document.body;
  var base = body.dataset.base || "";
  var poll = body.dataset.poll;
  var every = parseInt(body.dataset.pollMs, 10) || 2000;
  var STATUSES = ["queued", "running", "retrying", "succeeded", "failed", "cancelled"];
  var live = document.getElementById("live");

  function cell(row, text) {
    var td = document.createElement("td");
    td.textContent = text;
    row.appendChild(td);
    return td;
  }

  function runHref(id) {
    return base + "/run?" + new URLSearchParams({ id: id }).toString();
  }

  function renderRuns(data) {
    var tbody = document.getElementById("rows");
    var fresh = document.createDocumentFragment();
    data.rows.forEach(function (r) {
      var tr = document.createElement("tr");
      tr.dataset.id = r.id;
      var link = document.createElement("a");
      link.href = runHref(r.id);
      link.textContent = r.id;
      cell(tr, "").appendChild(link);
      cell(tr, r.task);
      var status = cell(tr, r.status_text);
      status.className = "status" + (STATUSES.indexOf(r.status) >= 0 ? " status-" + r.status : "");
      [r.attempt, r.owner, r.lease, r.progress, r.created, r.updated, r.failure].forEach(function (v) {
        cell(tr, v);
      });
      fresh.appendChild(tr);
    });
    if (!data.rows.length) {
      var empty = document.createElement("tr");
      empty.className = "empty";
      cell(empty, "no runs match").colSpan = 10;
      fresh.appendChild(empty);
    }
    tbody.replaceChildren(fresh);
  }

  function renderRun(data) {
    data.fields.forEach(function (f) {
      var dd = document.querySelector('dd[data-field="' + f.name + '"]');
      if (dd) dd.textContent = f.text;
    });
    var actions = document.getElementById("actions");
    if (!actions || body.dataset.writable !== "yes") return;
    var fresh = document.createDocumentFragment();
    data.actions.forEach(function (name) {
      var a = document.createElement("a");
      a.className = "button";
      a.href = base + "/confirm?" + new URLSearchParams({ action: name, id: data.id }).toString();
      a.textContent = name.charAt(0).toUpperCase() + name.slice(1);
      fresh.appendChild(a);
      fresh.appendChild(document.createTextNode(" "));
    });
    actions.replaceChildren(fresh);
  }

  function renderOverview(data) {
    data.statuses.forEach(function (s) {
      var td = document.querySelector('td[data-count="' + s.status + '"]');
      if (td) td.textContent = String(s.count);
    });
    ["live_leases", "expired_leases", "taken_over"].forEach(function (name) {
      var dd = document.querySelector('dd[data-field="' + name + '"]');
      if (dd) dd.textContent = String(data[name]);
    });
    var oldest = document.querySelector('dd[data-field="oldest"]');
    if (oldest) {
      if (data.oldest) {
        var o = data.oldest;
        var a = document.createElement("a");
        a.href = runHref(o.id);
        a.textContent = o.id;
        oldest.replaceChildren(a, document.createTextNode(
          " (" + o.task + ", " + o.owner + ", running for " + o.running_for + ", " + o.lease + ")"));
      } else {
        oldest.textContent = "none";
      }
    }
    var tbody = document.getElementById("tasks");
    var fresh = document.createDocumentFragment();
    data.tasks.forEach(function (t) {
      var tr = document.createElement("tr");
      var link = document.createElement("a");
      link.href = base + "/runs?" + new URLSearchParams({ task: t.task }).toString();
      link.textContent = t.task;
      cell(tr, "").appendChild(link);
      t.live.concat(t.ended).forEach(function (n) { cell(tr, String(n)); });
      fresh.appendChild(tr);
    });
    if (!data.tasks.length) {
      var empty = document.createElement("tr");
      cell(empty, "no live runs and none ended in the last hour").colSpan = 7;
      fresh.appendChild(empty);
    }
    tbody.replaceChildren(fresh);
  }

  var render = { runs: renderRuns, run: renderRun, overview: renderOverview }[body.dataset.page];
  if (!poll || !render) return;

  function refresh() {
    fetch(poll, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.json();
      })
      .then(function (data) {
        render(data);
        if (live) live.textContent = "live · " + new Date().toLocaleTimeString();
      })
      .catch(function (error) {
        if (live) live.textContent = "not updating: " + error.message;
      })
      .finally(function () {
        setTimeout(refresh, every);
      });
  }
  setTimeout(refresh, every);
})();
