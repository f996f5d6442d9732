(function () {
  'use strict';
  var table = document.getElementById('rollouts');
  var body = table.tBodies[0];
  var rows = Array.prototype.slice.call(body.rows);
  var search = document.getElementById('search');
  var crashed = document.getElementById('only-crashed');
  var minAttempts = document.getElementById('min-attempts');
  var shown = document.getElementById('shown');
  var statuses = {};

  function apply() {
    var q = search.value.trim().toLowerCase();
    var anyStatus = Object.keys(statuses).some(function (k) { return statuses[k]; });
    var min = Number(minAttempts.value) || 0;
    var n = 0;
    rows.forEach(function (tr) {
      var ok = (!q || tr.getAttribute('data-search').indexOf(q) >= 0) &&
        (!anyStatus || statuses[tr.getAttribute('data-status')]) &&
        (!crashed.checked || tr.getAttribute('data-crashed') === '1') &&
        Number(tr.getAttribute('data-attempts')) >= min;
      tr.classList.toggle('hidden', !ok);
      if (ok) { n += 1; }
    });
    shown.textContent = n + ' of ' + rows.length + ' rollouts shown';
    document.body.setAttribute('data-shown', String(n));
  }
  document.querySelectorAll('.chips button').forEach(function (b) {
    b.addEventListener('click', function () {
      var s = b.getAttribute('data-status');
      statuses[s] = !statuses[s];
      b.classList.toggle('on', statuses[s]);
      apply();
    });
  });
  [search, crashed, minAttempts].forEach(function (el) { el.addEventListener('input', apply); });

  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
    th.addEventListener('click', function () {
      var numeric = th.classList.contains('num');
      var desc = th.classList.contains('sorted-asc');
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (h) { h.classList.remove('sorted-asc', 'sorted-desc'); });
      th.classList.add(desc ? 'sorted-desc' : 'sorted-asc');
      rows.sort(function (a, b) {
        var x = a.cells[col].getAttribute('data-v'), y = b.cells[col].getAttribute('data-v');
        var c = numeric ? (Number(x) - Number(y)) : x.localeCompare(y);
        if (numeric && isNaN(c)) { c = isNaN(Number(x)) ? (isNaN(Number(y)) ? 0 : -1) : 1; }
        return desc ? -c : c;
      });
      rows.forEach(function (tr) { body.appendChild(tr); });
    });
  });
  apply();
  document.body.setAttribute('data-ready', String(rows.length));
})();
