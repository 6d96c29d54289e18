"""GroupShape: which block of the input one quantization scale covers (vLLM's name and values).

``GroupShape(row, col)``: ``-1`` means "the whole dimension". A scale covers ``row`` tokens by
``col`` hidden elements:

- ``PER_TENSOR = (-1, -1)``: one scale for the tensor.
- ``PER_TOKEN = (1, -1)``: one scale per row (token).
- ``PER_CHANNEL = (-1, 1)``: one scale per column (static scales only).
- per-group ``(1, G)``: one scale per run of ``G`` consecutive elements of a row.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple


class _GroupShape(NamedTuple):
    row: int
    col: int


class GroupShape(_GroupShape):
    """A ``(row, col)`` pair; a NamedTuple so that it compares equal to the plain tuple."""

    PER_TENSOR: ClassVar[GroupShape]
    PER_TOKEN: ClassVar[GroupShape]
    PER_CHANNEL: ClassVar[GroupShape]

    def __new__(cls, row: int, col: int) -> GroupShape:
        for field, value in (("row", row), ("col", col)):
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
                raise ValueError(f"GroupShape: {field} must be -1 (whole dimension) or >= 1, got {value!r}")
        return super().__new__(cls, row, col)

    def is_per_tensor(self) -> bool:
        return self.row == -1 and self.col == -1

    def is_per_token(self) -> bool:
        return self.row == 1 and self.col == -1

    def is_per_channel(self) -> bool:
        return self.row == -1 and self.col == 1

    def is_per_group(self) -> bool:
        """One row, ``col`` elements: the token-group shape (``col`` is the group size)."""
        return self.row == 1 and self.col >= 1


GroupShape.PER_TENSOR = GroupShape(-1, -1)
GroupShape.PER_TOKEN = GroupShape(1, -1)
GroupShape.PER_CHANNEL = GroupShape(-1, 1)
