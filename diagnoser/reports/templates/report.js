(function () {
  "use strict";
  // Tables marked data-sortable sort by a click on a header; without JavaScript they keep the server's order.
  function key(row, col, numeric) {
    var cell = row.cells[col];
    var raw = cell.hasAttribute("data-v") ? cell.getAttribute("data-v") : cell.textContent.trim();
    if (!numeric) return raw.toLowerCase();
    var n = parseFloat(raw);
    return isNaN(n) ? -Infinity : n;
  }
  Array.prototype.forEach.call(document.querySelectorAll("table[data-sortable]"), function (table) {
    var heads = table.tHead.rows[0].cells;
    Array.prototype.forEach.call(heads, function (th, col) {
      if (!th.hasAttribute("data-sort")) return;
      var button = document.createElement("button");
      button.type = "button";
      button.textContent = th.textContent;
      th.textContent = "";
      th.appendChild(button);
      button.addEventListener("click", function () {
        var numeric = th.getAttribute("data-sort") === "num";
        var ascending = th.getAttribute("aria-sort") === "descending";
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var x = key(a, col, numeric), y = key(b, col, numeric);
          var order = x < y ? -1 : x > y ? 1 : 0;
          return ascending ? order : -order;
        });
        rows.forEach(function (row) { body.appendChild(row); });
        Array.prototype.forEach.call(heads, function (other) { other.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
        // The sentence above the table (and on paper) says the order the rows are in now.
        var note = document.getElementById(table.getAttribute("data-sort-note") || "");
        if (note) {
          var order = numeric ? (ascending ? "lowest first" : "highest first") : (ascending ? "A to Z" : "Z to A");
          note.textContent = "Sorted by " + (th.getAttribute("title") || button.textContent) + ", " + order + ".";
        }
      });
    });
  });
  // On paper nothing can be clicked open: print every collapsed section.
  window.addEventListener("beforeprint", function () {
    Array.prototype.forEach.call(document.querySelectorAll("details:not(.fullname)"), function (d) { d.open = true; });
  });
})();
