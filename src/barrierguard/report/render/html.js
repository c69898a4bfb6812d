
(function () {
  var table = document.getElementById("sites");
  if (!table) { return; }
  var heads = table.tHead.rows[0].cells;
  function value(row, i) {
    var cell = row.cells[i];
    var v = cell.getAttribute("data-sort");
    if (v !== null) { var n = parseFloat(v); return isNaN(n) ? v : n; }
    return cell.textContent.toLowerCase();
  }
  function sortBy(i, descending) {
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = value(a, i), y = value(b, i);
      var c = (typeof x === "number" && typeof y === "number") ? x - y
        : String(x).localeCompare(String(y));
      return descending ? -c : c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
    for (var j = 0; j < heads.length; j++) { heads[j].removeAttribute("aria-sort"); }
    heads[i].setAttribute("aria-sort", descending ? "descending" : "ascending");
    table.setAttribute("data-sorted-by", heads[i].getAttribute("data-key")
      + (descending ? ":desc" : ":asc"));
  }
  Array.prototype.forEach.call(heads, function (th, i) {
    th.addEventListener("click", function () {
      var numeric = th.getAttribute("data-type") === "num";
      var current = th.getAttribute("aria-sort");
      var descending = current ? current === "ascending" : numeric;
      sortBy(i, descending);
    });
  });
  var m = /[#&]sort=(-?)([a-z_]+)/.exec(window.location.hash);
  if (m) {
    for (var i = 0; i < heads.length; i++) {
      if (heads[i].getAttribute("data-key") === m[2]) { sortBy(i, m[1] === "-"); }
    }
  }
})();
