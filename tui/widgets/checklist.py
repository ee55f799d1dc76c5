"""A SelectionList and a Checkbox whose marks read without colour: `[x]`
picked, `[ ]` not.

Textual's own draw the same `X` glyph for both states and tell them apart
by colour alone."""

from __future__ import annotations

from rich.segment import Segment
from textual.content import Content
from textual.strip import Strip
from textual.widgets import Checkbox, SelectionList
from textual.widgets.option_list import OptionDoesNotExist


class CheckList(SelectionList[str]):
    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        segments = list(strip)
        try:
            option = self.get_option_at_index(self.scroll_offset.y + y)
        except OptionDoesNotExist:
            return strip
        if len(segments) < 3:
            return strip
        # The parent draws a 3-cell button first; same cells, new text, the
        # button's own style (it carries the option index clicks need).
        style = segments[1].style
        mark = "x" if option.value in self.selected else " "
        return Strip([Segment("[", style), Segment(mark, style), Segment("]", style), *segments[3:]], strip.cell_length)


class CheckBox(Checkbox):
    @property
    def _button(self) -> Content:
        return Content.assemble(("[x]" if self.value else "[ ]", self.get_visual_style("toggle--button")))
