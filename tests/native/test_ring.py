"""velox._native.Ring: FIFO semantics, bad input, threads, and the garbage collector."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from velox._native import Ring


def test_fifo_push_pop_and_len() -> None:
    ring = Ring(8)
    assert ring.capacity == 8
    assert len(ring) == 0
    assert not ring
    assert ring.try_pop() is None
    for i in range(8):
        assert ring.try_push(i) is True
    assert len(ring) == 8
    assert ring.try_push("overflow") is False  # full: refuses, never grows
    assert len(ring) == 8
    assert [ring.try_pop() for _ in range(8)] == list(range(8))
    assert ring.try_pop() is None
    assert len(ring) == 0


def test_keyword_capacity_and_minimum() -> None:
    assert Ring(capacity=2).capacity == 2
    assert Ring(16384).capacity == 16384


def test_many_laps_keep_order() -> None:
    ring = Ring(4)
    expected = 0
    pushed = 0
    for lap in range(1000):
        for _ in range(1 + lap % 4):
            assert ring.try_push(pushed)
            pushed += 1
        while (item := ring.try_pop()) is not None:
            assert item == expected
            expected += 1
    assert expected == pushed


def test_pop_batch_order_limits_and_empty() -> None:
    ring = Ring(16)
    assert ring.pop_batch() == []
    assert ring.pop_batch(5) == []
    for i in range(10):
        ring.try_push(i)
    assert ring.pop_batch(3) == [0, 1, 2]
    assert ring.pop_batch() == [3, 4, 5, 6, 7, 8, 9]  # default 64, only 7 there
    assert ring.pop_batch() == []
    for i in range(16):
        ring.try_push(i)
    assert ring.pop_batch(10**30) == list(range(16))  # huge max_n: everything, no error
    # Mixed with single pops across the wrap-around point.
    for i in range(12):
        ring.try_push(i)
    assert ring.try_pop() == 0
    assert ring.pop_batch(4) == [1, 2, 3, 4]
    for i in range(12, 20):
        assert ring.try_push(i)
    assert ring.pop_batch(64) == list(range(5, 20))


def test_pop_batch_larger_than_one_internal_chunk() -> None:
    ring = Ring(1024)
    for i in range(1000):
        ring.try_push(i)
    assert ring.pop_batch(600) == list(range(600))
    assert ring.pop_batch(1000) == list(range(600, 1000))


def test_none_is_stored_but_indistinguishable_from_empty() -> None:
    ring = Ring(2)
    assert ring.try_push(None)
    assert len(ring) == 1
    assert ring.try_pop() is None  # the documented ambiguity
    assert len(ring) == 0


@pytest.mark.parametrize("bad", [0, 1, 3, 6, 12, 1000, -1, -2, -16, 2**31, 2**64, 2**100,
                                 -(2**100)])
def test_bad_capacity_is_value_error_naming_value(bad: int) -> None:
    with pytest.raises(ValueError) as info:
        Ring(bad)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("bad", [4.0, "8", None, [8]])
def test_non_int_capacity_is_type_error(bad: object) -> None:
    with pytest.raises(TypeError):
        Ring(bad)  # type: ignore[arg-type]


def test_bad_pop_batch_arguments() -> None:
    ring = Ring(4)
    ring.try_push(1)
    for bad in (0, -1, -(2**80)):
        with pytest.raises(ValueError) as info:
            ring.pop_batch(bad)
        assert str(bad) in str(info.value)
    with pytest.raises(TypeError):
        ring.pop_batch(2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ring.pop_batch(1, 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ring.try_push()  # type: ignore[call-arg]
    assert ring.try_pop() == 1  # failed calls took nothing


def test_capacity_is_read_only() -> None:
    ring = Ring(4)
    with pytest.raises(AttributeError):
        ring.capacity = 8  # type: ignore[misc]


def test_threads_no_loss_no_duplicate_fifo_per_producer() -> None:
    """4 producer and 4 consumer threads (the GIL serialises them, but switches land anywhere
    between the C calls)."""
    ring = Ring(64)
    producers, consumers, per_producer = 4, 4, 5000
    total = producers * per_producer
    taken: list[list[tuple[int, int]]] = [[] for _ in range(consumers)]
    done = threading.Event()
    lock = threading.Lock()
    count = [0]

    deadline = time.monotonic() + 120  # a guard so a broken ring fails instead of hanging

    def produce(pid: int) -> None:
        seq = 0
        while seq < per_producer and time.monotonic() < deadline:
            if ring.try_push((pid, seq)):
                seq += 1
            else:
                time.sleep(0)  # full: let a consumer have the GIL

    def consume(cid: int) -> None:
        out = taken[cid]
        while not done.is_set() and time.monotonic() < deadline:
            batch = ring.pop_batch(1 + cid * 7) if cid % 2 else [ring.try_pop()]
            batch = [x for x in batch if x is not None]
            if not batch:
                time.sleep(0)  # empty: let a producer have the GIL
                continue
            out.extend(batch)
            with lock:
                count[0] += len(batch)
                if count[0] >= total:
                    done.set()

    threads = [threading.Thread(target=consume, args=(c,)) for c in range(consumers)]
    threads += [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads)

    everything = [item for out in taken for item in out]
    assert len(everything) == total
    assert set(everything) == {(p, s) for p in range(producers) for s in range(per_producer)}
    for out in taken:
        last = dict.fromkeys(range(producers), -1)
        for pid, seq in out:
            assert seq > last[pid]
            last[pid] = seq


def test_gc_sees_items_and_collects_cycles() -> None:
    class Node:
        pass

    node = Node()
    ring = Ring(4)
    ring.try_push(node)
    assert node in gc.get_referents(ring)

    # ring -> node -> ring: only the collector can free this.
    node.ring = ring  # type: ignore[attr-defined]
    ring_ref = weakref.ref(ring)
    node_ref = weakref.ref(node)
    del ring, node
    gc.collect()
    assert ring_ref() is None
    assert node_ref() is None


def test_ring_containing_itself_is_collected() -> None:
    ring = Ring(2)
    ring.try_push(ring)
    ref = weakref.ref(ring)
    del ring
    gc.collect()
    assert ref() is None


def test_not_subclassable_or_picklable() -> None:
    import pickle

    with pytest.raises(TypeError):

        class Sub(Ring):  # type: ignore[misc]
            pass

    with pytest.raises(TypeError):
        pickle.dumps(Ring(2))


def test_deeply_nested_rings_are_freed_without_recursing_to_death() -> None:
    inner = Ring(2)
    ref = weakref.ref(inner)
    ring = inner
    for _ in range(200_000):  # dealloc goes through the trashcan, not 200k C frames
        outer = Ring(2)
        outer.try_push(ring)
        ring = outer
    del inner, outer, ring
    assert ref() is None
