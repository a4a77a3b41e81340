/* Batchery's web console: refreshes the server-rendered part of a page (#live) every two seconds while there is
   something to watch, draws a job's counts over time with uPlot, and asks before a cancel. Everything shown comes
   from the server already HTML-escaped; nothing here builds markup from data. */
(function () {
  "use strict";
  var PERIOD_MS = 2000;
  var chart = null;

  document.addEventListener("submit", function (ev) {
    var form = ev.target;
    if (form.classList && form.classList.contains("confirm") && !window.confirm(form.dataset.confirm || "Sure?")) {
      ev.preventDefault();
    }
  });

  function fragmentUrl() {
    var u = new URL(window.location.href);
    u.searchParams.set("fragment", "1");
    return u.toString();
  }

  function active() {
    var live = document.getElementById("live");
    if (!live) return false;
    var marker = live.querySelector("#still-active");
    if (document.getElementById("chart")) return !!marker && marker.dataset.active === "1";
    return true; // the jobs and workers pages: new jobs and workers may come at any time
  }

  function chartWidth(el) {
    return Math.max(320, Math.min(1100, el.clientWidth || 900));
  }

  function drawChart() {
    var el = document.getElementById("chart");
    if (!el || typeof uPlot === "undefined") return Promise.resolve();
    return fetch(el.dataset.series, { credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (s) {
        if (!s) return;
        var data = [s.t, s.completed, s.failed, s.tokens_per_s];
        el.dataset.points = String(s.t.length);
        if (chart === null) {
          chart = new uPlot({
            width: chartWidth(el),
            height: 260,
            series: [
              {},
              { label: "completed", stroke: "#2e7d32", width: 2 },
              { label: "failed", stroke: "#c62828", width: 2 },
              { label: "tokens/s", stroke: "#1565c0", width: 1, scale: "tps", dash: [4, 4] }
            ],
            axes: [
              {},
              { label: "lines" },
              { label: "tokens/s", scale: "tps", side: 1, grid: { show: false } }
            ],
            scales: { x: { time: true } }
          }, data, el);
        } else {
          chart.setData(data);
        }
      })
      .catch(function () { /* the next tick tries again */ });
  }

  function refresh() {
    var live = document.getElementById("live");
    return fetch(fragmentUrl(), { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (r) {
        if (r.redirected || r.status === 401 || r.status === 403) { window.location.reload(); return null; }
        return r.ok ? r.text() : null;
      })
      .then(function (html) { if (html !== null && live) live.innerHTML = html; })
      .catch(function () { /* the next tick tries again */ });
  }

  function tick() {
    var work = Promise.resolve();
    if (!document.hidden && active()) {
      work = refresh().then(drawChart);
    }
    work.then(function () { window.setTimeout(tick, PERIOD_MS); });
  }

  document.addEventListener("DOMContentLoaded", function () {
    drawChart().then(function () { window.setTimeout(tick, PERIOD_MS); });
  });
})();
