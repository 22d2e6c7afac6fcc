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
    actions.replaceChildren(buttons(data.actions, { id: data.id }));
  }

  function buttons(list, target) {
    var fresh = document.createDocumentFragment();
    list.forEach(function (action) {
      var a = document.createElement("a");
      a.className = "button";
      var params = new URLSearchParams({ action: action.name });
      Object.keys(target).forEach(function (k) { params.set(k, target[k]); });
      a.href = base + "/confirm?" + params.toString();
      a.textContent = action.label;
      fresh.appendChild(a);
      fresh.appendChild(document.createTextNode(" "));
    });
    return fresh;
  }

  function taskLink(name) {
    var link = document.createElement("a");
    link.href = base + "/task?" + new URLSearchParams({ name: name }).toString();
    link.textContent = name;
    return link;
  }

  // Rows of text cells (the first a link to the task page when `linked`), or one
  // empty row saying `none`.
  function fillTable(id, rows, columns, none, linked) {
    var tbody = document.getElementById(id);
    if (!tbody) return;
    var fresh = document.createDocumentFragment();
    rows.forEach(function (r) {
      var tr = document.createElement("tr");
      columns.forEach(function (c, i) {
        if (i === 0 && linked) cell(tr, "").appendChild(taskLink(r[c]));
        else cell(tr, String(r[c]));
      });
      fresh.appendChild(tr);
    });
    if (!rows.length) {
      var empty = document.createElement("tr");
      empty.className = "empty";
      cell(empty, none).colSpan = columns.length;
      fresh.appendChild(empty);
    }
    tbody.replaceChildren(fresh);
  }

  function setFields(data, names) {
    names.forEach(function (name) {
      var dd = document.querySelector('dd[data-field="' + name + '"]');
      if (dd) dd.textContent = String(data[name]);
    });
  }

  function setCounts(statuses) {
    statuses.forEach(function (s) {
      var td = document.querySelector('td[data-count="' + s.status + '"]');
      if (td) td.textContent = String(s.count);
    });
  }

  function setRecovery(recovery) {
    recovery.forEach(function (c) {
      var dd = document.querySelector('dd[data-field="' + c.name + '"]');
      if (dd) dd.textContent = String(c.count);
    });
  }

  function renderTask(data) {
    setFields(data, ["state", "held", "expired_leases"]);
    setCounts(data.statuses);
    setRecovery(data.recovery);
    fillTable("pauses", data.pauses, ["key", "reason", "since", "held"], "no pause", false);
    fillTable("rates", data.rate_limited, ["key", "limit", "waiting", "next_slot"], "no rate limit", false);
    var actions = document.getElementById("actions");
    if (actions && body.dataset.writable === "yes") {
      actions.replaceChildren(buttons(data.actions, { task: data.task }));
    }
  }

  function renderOverview(data) {
    setCounts(data.statuses);
    setFields(data, ["live_leases", "expired_leases", "sweeper", "beats"]);
    setRecovery(data.recovery);
    fillTable("paused", data.paused, ["task", "key", "reason", "since", "held"],
      "nothing is paused", true);
    fillTable("rates", data.rate_limited, ["task", "key", "limit", "waiting", "next_slot"],
      "no task has a lease_rate_limit", true);
    var oldest = document.querySelector('dd[data-field="oldest"]');
    if (oldest) {
      if (data.oldest) {
        var o = data.oldest;
        var a = document.createElement("a");
        a.href = runHref(o.id);
        a.textContent = o.id;
        oldest.replaceChildren(a, document.createTextNode(
          " (" + o.task + ", " + o.owner + ", first claimed " + o.running_for + " ago, " + o.lease + ")"));
      } else {
        oldest.textContent = "none";
      }
    }
    var tbody = document.getElementById("tasks");
    var fresh = document.createDocumentFragment();
    data.tasks.forEach(function (t) {
      var tr = document.createElement("tr");
      cell(tr, "").appendChild(taskLink(t.task));
      t.live.concat(t.ended, [t.taken_over, t.republished]).forEach(function (n) {
        cell(tr, String(n));
      });
      var runs = document.createElement("a");
      runs.href = base + "/runs?" + new URLSearchParams({ task: t.task }).toString();
      runs.textContent = "runs";
      cell(tr, "").appendChild(runs);
      fresh.appendChild(tr);
    });
    if (!data.tasks.length) {
      var empty = document.createElement("tr");
      empty.className = "empty";
      cell(empty, "no live runs and none ended in the last hour").colSpan = 10;
      fresh.appendChild(empty);
    }
    tbody.replaceChildren(fresh);
  }

  var render = {
    runs: renderRuns, run: renderRun, overview: renderOverview, task: renderTask,
  }[body.dataset.page];
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
