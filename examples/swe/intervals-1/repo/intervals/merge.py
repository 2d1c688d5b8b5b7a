"""Merging closed intervals [start, end]."""


def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of `intervals` as sorted, disjoint intervals. Closed intervals that share an end point, such as
    (1, 3) and (3, 5), overlap and merge into one."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_length(intervals: list[tuple[int, int]]) -> int:
    """The length covered by `intervals` (overlaps counted once)."""
    return sum(end - start for start, end in merge(intervals))
