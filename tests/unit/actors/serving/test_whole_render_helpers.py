"""The pure helpers behind the proxy's whole-conversation rendering (a checkpoint's own template): texts and ids
kept in shared pieces must read as their concatenation, on random pieces."""

from __future__ import annotations

import random

from gyre.actors.serving.sessions import _agreeing_chars, _cuts_up_to, _head_parts, _head_text, _Path, _path_window


def random_pieces(rng: random.Random, alphabet: str) -> tuple[str, ...]:
    return tuple("".join(rng.choice(alphabet) for _ in range(rng.randrange(5))) for _ in range(rng.randrange(5)))


def test_agreeing_chars_is_the_common_prefix_of_the_concatenation() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        pieces = random_pieces(rng, "ab")
        whole = "".join(pieces)
        text = whole[: rng.randrange(len(whole) + 1)] + "".join(rng.choice("ab") for _ in range(rng.randrange(4)))
        expected = 0
        while expected < min(len(text), len(whole)) and text[expected] == whole[expected]:
            expected += 1
        assert _agreeing_chars(text, pieces) == expected


def test_heads_of_pieces_parts_and_windows() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        pieces = random_pieces(rng, "xyz")
        whole = "".join(pieces)
        chars = rng.randrange(len(whole) + 1)
        assert "".join(_head_text(pieces, chars)) == whole[:chars]
        parts = tuple(tuple(rng.randrange(9) for _ in range(rng.randrange(4))) for _ in range(rng.randrange(1, 5)))
        ends = tuple(sum(len(p) for p in parts[: i + 1]) for i in range(len(parts)))
        ids = sum(parts, ())
        tokens = rng.randrange(len(ids) + 1)
        head, head_ends = _head_parts(parts, ends, tokens)
        assert sum(head, ()) == ids[:tokens] and (not head_ends or head_ends[-1] == tokens)
        path = _Path(None, None, [], parts, ends, None, None, 0, ())
        path.output = tuple(rng.randrange(9) for _ in range(rng.randrange(3)))
        start, count = rng.randrange(len(ids) + len(path.output) + 2), rng.randrange(6)
        assert _path_window(path, start, count) == (ids + path.output)[start : start + count]


def test_cuts_up_to_keeps_the_cuts_at_or_before_a_position() -> None:
    rng = random.Random(2)
    for _ in range(1000):
        flat = sorted({(rng.randrange(50), 0) for _ in range(rng.randrange(8))})
        flat = [(c, i) for i, (c, _) in enumerate(flat)]
        segments, at = [], 0
        while at < len(flat):
            size = rng.randrange(0, 3)
            segments.append(tuple(flat[at : at + size]))
            at += size
        chars = rng.randrange(55)
        kept = [cut for segment in _cuts_up_to(tuple(segments), chars) for cut in segment]
        assert kept == [cut for cut in flat if cut[0] <= chars]
