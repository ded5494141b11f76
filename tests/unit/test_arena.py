from __future__ import annotations

from velox.ingress.arena import SEGMENTS, Arena


def test_body_is_copied_contiguously_and_readable_in_place() -> None:
    arena = Arena(64 * 1024)
    view, segment = arena.put([b'{"model":', b' "gpt-4o"}'])  # type: ignore[misc]
    assert bytes(view) == b'{"model": "gpt-4o"}'
    assert isinstance(view, memoryview) and segment == 0 and arena.live == 1


def test_too_big_or_empty_bodies_spill() -> None:
    arena = Arena(SEGMENTS * 1024)
    assert arena.put([b"x" * 1025]) is None
    assert arena.put([]) is None
    assert arena.spills == 2


def test_reset_rewinds_only_when_nothing_is_live() -> None:
    arena = Arena(SEGMENTS * 1024)
    first = arena.put([b"a" * 100])
    assert first is not None and arena.used == 100
    arena.reset()
    assert arena.used == 100  # still live: its bytes must not be reused
    arena.release(first[1])
    arena.reset()
    assert arena.used == 0


def test_a_live_body_pins_only_its_segment() -> None:
    arena = Arena(SEGMENTS * 1024)
    pinned = arena.put([b"p" * 1000])
    assert pinned is not None
    seen = {pinned[1]}
    # Fill every other segment, releasing as we go: allocation must skip the pinned one.
    for _ in range(4 * SEGMENTS):
        placed = arena.put([b"q" * 1000])
        assert placed is not None
        _view, segment = placed
        seen.add(segment)
        if segment != pinned[1]:
            arena.release(segment)
        assert bytes(pinned[0]) == b"p" * 1000, "a live body was overwritten"
    assert seen == set(range(SEGMENTS))


def test_all_segments_pinned_spills() -> None:
    arena = Arena(SEGMENTS * 1024)
    for _ in range(SEGMENTS):
        assert arena.put([b"z" * 1000]) is not None
    assert arena.put([b"z" * 1000]) is None
