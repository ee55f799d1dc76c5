"""Filling a DataTable in one go, each column as wide as its widest cell, and
reading the key of the row under its cursor.

Textual sizes auto-width columns on the table's next idle, and a paint that
comes first (rows added from a worker's callback race it) is cached with the
header-only widths: the cells stay cut at the header's width. Widths set
before the rows are added leave nothing to measure later.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from rich.cells import cell_len
from rich.text import Text
from textual.coordinate import Coordinate
from textual.widgets import DataTable


def _width(cell: object) -> int:
    return cell.cell_len if isinstance(cell, Text) else cell_len(str(cell))


def fill(table: DataTable, rows: Iterable[tuple[tuple, Optional[str]]]) -> None:
    """Replace the table's rows with `rows` ((cells, key) pairs), keeping its columns."""
    rows = list(rows)
    table.clear()
    for i, column in enumerate(table.ordered_columns):
        column.width = max([_width(column.label)] + [_width(cells[i]) for cells, _ in rows if i < len(cells)])
        column.auto_width = False
    for cells, key in rows:
        table.add_row(*cells, key=key)


def cursor_key(table: DataTable) -> str:
    """The key of the row under the cursor; "" when the table is empty or that row has no key."""
    if not table.row_count:
        return ""
    return table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0)).row_key.value or ""
