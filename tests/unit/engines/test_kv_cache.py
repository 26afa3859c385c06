"""KVCache row bookkeeping: select (reorder, repeat, drop), trim and concatenate, table-style."""

import numpy as np
import pytest

from service.engines.kv_cache import KVCache
from service.engines.kv_storage import CAPACITY_STEP, capacity_for


def cache(rows, length, start=0, encoder_row=None):
    keys = [np.arange(rows * length, dtype=np.float32).reshape(rows, 1, length, 1) + start]
    mask = np.ones((rows, length), np.int64)
    return KVCache(keys, [k + 0.5 for k in keys], mask, np.full(rows, length, np.int64),
                   None if encoder_row is None else np.asarray(encoder_row, np.int64))


@pytest.mark.parametrize("rows, expected_first_keys", [
    ([0, 1, 2], [0, 3, 6]),  # identity: nothing moves
    ([2, 0], [6, 0]),  # reorder and drop
    ([1, 1, 1, 1], [3, 3, 3, 3]),  # a beam expanding from one row
    ([], []),  # every request finished
])
def test_select(rows, expected_first_keys):
    c = cache(3, 3, encoder_row=[10, 11, 12])
    c.select(np.array(rows, dtype=np.int64))
    assert c.rows == len(rows)
    if not rows:
        assert c.keys[0].shape[0] == 0 and c.length == 0  # no rows: no slots either
        return
    assert c.keys[0][:, 0, 0, 0].tolist() == expected_first_keys
    assert c.values[0][:, 0, 0, 0].tolist() == [k + 0.5 for k in expected_first_keys]
    assert c.encoder_row.tolist() == [10 + r for r in rows]


def test_concatenate_left_pads_shorter_caches_with_masked_slots():
    merged = KVCache.concatenate([cache(1, 2, encoder_row=[0]), cache(2, 4, encoder_row=[0, 1])],
                                 encoder_offsets=[0, 1])
    assert merged.rows == 3 and merged.length == 4
    assert merged.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert merged.keys[0][0, 0, :, 0].tolist() == [0, 0, 0, 1]
    assert merged.positions.tolist() == [2, 4, 4]
    assert merged.encoder_row.tolist() == [0, 1, 2]


def test_dropping_the_longest_row_trims_unused_leading_slots():
    merged = KVCache.concatenate([cache(1, 2), cache(1, 5)])
    merged.select(np.array([0]))
    assert merged.length == 2 and merged.mask.tolist() == [[1, 1]]
    assert merged.keys[0].flags["C_CONTIGUOUS"]


def test_append_adopts_presents_and_extends_the_mask():
    c = KVCache.empty(2, n_layers=2, n_heads=1, head_dim=1)
    presents = [np.zeros((2, 1, 3, 1), np.float32) for _ in range(4)]
    c.append(presents, np.array([[0, 1, 1], [1, 1, 1]]), np.array([2, 3]))
    assert c.length == 3 and c.positions.tolist() == [2, 3] and len(c.feeds()) == 4
    assert set(c.feeds()) == {"past_key_values.0.key", "past_key_values.0.value",
                              "past_key_values.1.key", "past_key_values.1.value"}


def test_a_same_size_reordering_moves_only_the_changed_rows_in_place():
    c = cache(4, 3, encoder_row=[0, 0, 1, 1])
    keys = c.keys[0]
    c.select(np.array([0, 0, 2, 3]))  # beam 1 continues beam 0; the others stay
    assert c.keys[0] is keys  # no new array
    assert c.keys[0][:, 0, 0, 0].tolist() == [0, 0, 6, 9]
    assert c.values[0][:, 0, 0, 0].tolist() == [0.5, 0.5, 6.5, 9.5]
    assert c.encoder_row.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("rows, trimmed", [([3, 3, 0, 1], False), ([1, 0, 3, 2], False), ([1, 0, 0, 1], True)])
def test_a_reordering_of_most_rows_holds_what_a_gather_holds(rows, trimmed):
    """A beam step that moves more than half the rows of exact storage: one take per array when every slot stays
    in use (`KVCache._take`), the gather that trims leading slots otherwise; either way what `concatenate` of those
    rows holds, and the batch's arrays before are left as they were."""
    merged = KVCache.concatenate([cache(2, 2, encoder_row=[0, 0]), cache(2, 4, start=100, encoder_row=[1, 1])],
                                 encoder_offsets=[0, 1])  # rows 0-1 left-padded by two masked slots
    before = [a.copy() for a in (*merged.keys, *merged.values, merged.mask)]
    expected = KVCache.concatenate([merged], rows=[np.array(rows)])
    arrays = [*merged.keys, *merged.values, merged.mask]
    merged.select(np.array(rows))
    assert merged.length == (2 if trimmed else 4)
    for got, want in zip((*merged.keys, *merged.values, merged.mask, merged.positions, merged.encoder_row),
                         (*expected.keys, *expected.values, expected.mask, expected.positions, expected.encoder_row)):
        assert got.dtype == want.dtype and np.array_equal(got, want) and got.flags["C_CONTIGUOUS"]
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before))


@pytest.mark.parametrize("rows", [[0, 5, 1], [-1], [0, -2, 1]])
def test_bad_row_indices_are_an_error(rows):
    with pytest.raises(IndexError):
        cache(2, 2).select(np.array(rows))
    with pytest.raises(IndexError):
        KVCache.concatenate([cache(2, 2)], rows=[np.array(rows)])


def test_padding_slots_are_zero_whatever_memory_the_allocator_hands_back(monkeypatch):
    """`concatenate` writes each slot once: the gathered ones, and zeros in the padding (masked slots, left of a
    shorter exact cache's rows, right of a buffered one's), never what was in the memory before."""
    import service.engines.kv_cache as kv_cache

    def dirty(shape, dtype=float):
        return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 7, dtype)

    monkeypatch.setattr(kv_cache.np, "empty", dirty)
    merged = KVCache.concatenate([cache(1, 2), cache(2, 4)])  # exact: the short cache left-padded
    assert merged.keys[0][0, 0, :, 0].tolist() == [0, 0, 0, 1] and merged.mask[0].tolist() == [0, 0, 1, 1]
    grown = KVCache.concatenate([buffered(1, 2), cache(1, 3)])  # buffers: every row from slot 0, zeros after
    assert not np.isnan(grown.keys[0]).any() and not np.isnan(grown.values[0]).any()
    assert grown.keys[0][0, 0, 2:, 0].tolist() == [0] * (grown.capacity - 2)
    assert grown.mask.tolist() == [[1, 1] + [0] * (grown.capacity - 2), [1, 1, 1] + [0] * (grown.capacity - 3)]


# --- capacity buffers (in-place step graphs) -----------------------------------------------------------------

def buffered(rows, length, start=0):
    c = cache(rows, length, start)
    c.reserve(1)
    return c


def test_reserve_switches_to_buffers_and_grows_with_headroom():
    c = cache(2, 3)
    c.reserve(1)
    assert c.buffered and c.length == 3 and c.capacity == CAPACITY_STEP
    assert c.mask[:, 3:].sum() == 0 and c.keys[0][:, 0, :3, 0].tolist() == [[0, 1, 2], [3, 4, 5]]
    keys, positions = c.keys[0], c.positions
    for _ in range(CAPACITY_STEP - 3):
        assert c.open_slot().tolist() == [c.length] * 2
        c.advance()
        assert c.keys[0] is keys and c.positions is positions  # room left: the same buffers, written in place
    assert c.length == CAPACITY_STEP and c.positions.tolist() == [CAPACITY_STEP] * 2
    c.open_slot()
    assert c.capacity == capacity_for(CAPACITY_STEP + 1) > CAPACITY_STEP and c.keys[0] is not keys
    assert c.keys[0][:, 0, :3, 0].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_capacity_leaves_a_quarter_of_headroom_in_whole_steps():
    for slots in (0, 1, 15, 16, 17, 100, 144, 500):
        capacity = capacity_for(slots)
        assert capacity % CAPACITY_STEP == 0 and capacity >= max(slots, 1)
        assert capacity <= max(CAPACITY_STEP, 1.25 * slots + CAPACITY_STEP)


def _used(c: KVCache, row: int) -> list:
    """Row `row`'s keys at its used slots, in order: what attention sees, whatever the layout."""
    return c.keys[0][row, 0, np.flatnonzero(c.mask[row]), 0].tolist()


def _aligned_rows(c: KVCache) -> bool:
    """Buffers: every row's slots are [0, lengths[row]), nothing masked before them."""
    return all(c.mask[r, : c.lengths[r]].all() and not c.mask[r, c.lengths[r]:].any() for r in range(c.rows))


def test_buffers_select_and_concatenate_like_exact_storage_with_every_row_from_slot_0():
    exact = KVCache.concatenate([cache(1, 2), cache(2, 4, start=10)])
    merged = KVCache.concatenate([buffered(1, 2), buffered(2, 4, start=10)])
    assert merged.buffered and merged.length == exact.length and merged.capacity > merged.length
    assert merged.lengths.tolist() == [2, 4, 4] and _aligned_rows(merged)
    assert [_used(merged, r) for r in range(3)] == [_used(exact, r) for r in range(3)]
    for rows in ([2, 2, 0], [1, 2], [0]):  # in place, then gathers that drop the slots no kept row uses
        exact.select(np.array(rows))
        merged.select(np.array(rows))
        assert merged.buffered and _aligned_rows(merged) and merged.first_used_slot() == 0
        assert merged.length == max(merged.lengths) == max(len(_used(exact, r)) for r in range(exact.rows))
        assert [_used(merged, r) for r in range(merged.rows)] == [_used(exact, r) for r in range(exact.rows)]


def test_exact_rows_with_padding_move_to_slot_0_when_they_join_buffers():
    left_padded = KVCache.concatenate([cache(1, 2), cache(1, 4, start=10)])  # row 0: [pad, pad, 0, 1]
    joined = KVCache.concatenate([buffered(1, 3, start=20), left_padded])
    assert joined.lengths.tolist() == [3, 2, 4] and _aligned_rows(joined)
    assert [_used(joined, r) for r in range(3)] == [[20, 21, 22], [0, 1], [10, 11, 12, 13]]
    assert not joined.keys[0][1, 0, 2:].any()  # zero after a row's slots, as in a fresh buffer
    slots = joined.open_slot()
    assert slots.tolist() == [3, 2, 4] and joined.mask[[0, 1, 2], [3, 2, 4]].tolist() == [1, 1, 1]
    joined.advance()
    assert joined.lengths.tolist() == [4, 3, 5] and _aligned_rows(joined)


def test_a_cache_with_a_limit_grows_straight_to_it_and_keeps_it():
    """`KVCache.limit` (a step attention that reads used slots only): a full cache grows to the limit in one copy,
    then fills it in place; what is needed beyond it is still made room for; a join or a gather copies with the
    headroom (fresh memory costs page by page) and keeps the limit for its next growth."""
    c = buffered(2, 3)
    c.limit = 100
    for _ in range(CAPACITY_STEP - 3):
        c.open_slot()
        c.advance()
    keys = c.keys[0]
    assert c.capacity == CAPACITY_STEP  # room left: no growth yet, whatever the limit
    c.open_slot()
    assert c.capacity == 100 and c.keys[0] is not keys and c.mask.shape == (2, 100)
    assert c.keys[0][:, 0, :3, 0].tolist() == [[0, 1, 2], [3, 4, 5]] and not c.keys[0][:, :, CAPACITY_STEP:].any()
    c.advance()
    keys = c.keys[0]
    for _ in range(100 - CAPACITY_STEP - 1):
        c.open_slot()
        c.advance()
    assert c.keys[0] is keys and c.length == 100  # one growth for the whole run
    c.reserve(5)
    assert c.capacity == 105
    joined = KVCache.concatenate([c, buffered(1, 4)])  # a join: the headroom, and the limit for its growth
    assert joined.limit == 100 and joined.capacity == capacity_for(101)
    keys = c.keys[0]
    c.select(np.array([1]))  # a departure: closed up in place, the capacity kept
    assert c.limit == 100 and c.capacity == 105 and np.shares_memory(c.keys[0], keys)
    c.select(np.array([0, 0]))  # a gather (a row repeated): a copy, with the headroom
    assert c.limit == 100 and c.capacity == capacity_for(101)
    short = buffered(3, 5)
    short.limit = 64
    gathered = KVCache.concatenate([short], rows=[np.array([2, 0])])
    assert gathered.capacity == capacity_for(6) < 64
    for _ in range(gathered.capacity - 5 + 1):  # one more than it holds
        gathered.open_slot()
        gathered.advance()
    assert gathered.capacity == 64


@pytest.mark.parametrize("limit", [None, 40])
def test_exact_storage_moves_into_buffers_of_the_grown_capacity_in_one_copy(limit):
    """`reserve` from exact storage: every row's used slots at [0, length) in their order, zeros and an unused mask
    after them, in buffers already of the capacity the growth asks for (the limit, or the headroom over the
    longest row), the same contents as moving them at the same width first and growing after."""
    exact = KVCache.concatenate([cache(1, 2, start=100), cache(2, 5)])  # the short row left-padded by 3 slots
    exact.mask[2, 4] = 0  # and a masked slot inside the last row
    exact.limit = limit
    used = [_used(exact, row) for row in range(exact.rows)]
    exact.reserve(3)
    longest = max(len(u) for u in used)
    assert exact.buffered and exact.capacity == (limit or capacity_for(longest + 3))
    assert exact.lengths.tolist() == [len(u) for u in used] and _aligned_rows(exact)
    for row, expected in enumerate(used):
        assert exact.keys[0][row, 0, : len(expected), 0].tolist() == expected
        assert not exact.keys[0][row, :, len(expected):].any() and not exact.values[0][row, :, len(expected):].any()
    assert exact.values[0][0, 0, :2, 0].tolist() == [100.5, 101.5]


def test_buffers_grown_to_a_limit_are_fresh_zero_pages_and_headroom_growth_is_not():
    """A buffer grown to `limit` at once is mostly slots never written: it is fresh anonymous memory (nothing zeroed
    ahead; `kv_storage.zeroed`), zero, writable and contiguous as a bound buffer must be; a buffer grown with a
    headroom is read whole by its attention and stays an ordinary array."""
    import mmap

    from service.engines.kv_storage import FRESH_PAGES_BYTES, zeroed

    rows, heads, head_dim, limit = 8, 4, 64, 256
    assert rows * heads * limit * head_dim * 4 >= FRESH_PAGES_BYTES
    keys = [np.ones((rows, heads, 3, head_dim), np.float32)]
    for grown_limit, fresh in ((limit, True), (None, False)):
        c = KVCache(keys, [k * 2 for k in keys], np.ones((rows, 3), np.int64), np.full(rows, 3, np.int64))
        c.limit = grown_limit
        c.reserve(1)
        buffer = c.keys[0]
        owner = buffer
        while isinstance(owner, (np.ndarray, memoryview)):  # the memory the array's views end at
            owner = owner.base if isinstance(owner, np.ndarray) else owner.obj
        assert isinstance(owner, mmap.mmap) is fresh
        assert buffer.flags.c_contiguous and buffer.flags.writeable and buffer.dtype == np.float32
        assert buffer[:, :, :3].all() and not buffer[:, :, 3:].any() and (c.values[0][:, :, :3] == 2).all()
        buffer[:, :, 3] = 5  # written in place, as a step does
        assert (c.keys[0][:, :, 3] == 5).all()
    small = zeroed((2, 3), np.int64)
    assert small.base is None and not small.any()  # small buffers: plain np.zeros


# --- joins and departures in the running batch's own buffers (RowStorage) -------------------------------------

def _running():
    """A buffered batch of 4 rows of different lengths (5, 5, 3, 3 slots), with room for more rows."""
    return KVCache.concatenate([buffered(2, 5), buffered(2, 3, start=100)])


def _graph_view(c: KVCache) -> list:
    """What a step reads of each row: its used keys and values, its mask, position and length."""
    return [(c.keys[0][r, :, : c.lengths[r]].tolist(), c.values[0][r, :, : c.lengths[r]].tolist(),
             c.mask[r].tolist(), int(c.positions[r]), int(c.lengths[r])) for r in range(c.rows)]


def _unused_slots_are_zero(c: KVCache) -> bool:
    """Every slot of the storage that no row uses is zero: after each row's length, and in every row after them."""
    s = c.storage
    used = np.arange(c.capacity) < np.pad(c.lengths, (0, s.rows - c.rows))[:, None]  # (storage rows, slots)
    return all(not array[~used].any() for array in (*(a[:, 0, :, 0] for a in (*s.keys, *s.values)), s.mask))


@pytest.mark.parametrize("kept", [[0, 1, 2, 3], [1, 2, 3], [0, 2], [3], []])
@pytest.mark.parametrize("newcomer", [lambda: cache(1, 4, start=50), lambda: buffered(1, 4, start=50)],
                         ids=["exact", "buffered"])
def test_a_join_in_place_holds_what_a_copy_holds_in_the_batchs_own_buffers(kept, newcomer):
    kept = np.array(kept, np.int64)
    copied = KVCache.concatenate([_running(), newcomer()], rows=[kept, None])
    running = _running()
    storage, keys = running.storage, running.keys[0]
    joined = KVCache.concatenate([running, newcomer()], rows=[kept, None], in_place=True)
    assert joined is running and joined.storage is storage and np.shares_memory(joined.keys[0], keys)
    assert _graph_view(joined) == _graph_view(copied) and joined.capacity == running.capacity
    assert _unused_slots_are_zero(joined)


def test_a_departure_closes_up_in_place_like_a_gather():
    gathered, closed = _running(), _running()
    storage = closed.storage
    KVCache.select(gathered, np.array([2, 0, 3]))  # not in order: a gather into new buffers
    assert gathered.storage is not storage
    closed.select(np.array([0, 2, 3]))
    assert closed.storage is storage and _unused_slots_are_zero(closed)
    expected = _running()
    expected = KVCache.concatenate([expected], rows=[np.array([0, 2, 3])])
    assert _graph_view(closed) == _graph_view(expected)


@pytest.mark.parametrize("case", ["rows out of order", "more rows than the storage", "a longer newcomer",
                                  "slots too wide", "the same cache twice"])
def test_a_join_that_the_buffers_cannot_take_is_a_copy_and_leaves_the_batch_as_it_was(case):
    running = _running()
    before = _graph_view(running)
    others, kept = [cache(1, 4, start=50)], np.arange(4)
    if case == "rows out of order":
        kept = np.array([1, 0, 2, 3])
    elif case == "more rows than the storage":
        others = [cache(running.storage.rows - 3, 2)]
    elif case == "a longer newcomer":
        others = [cache(1, running.capacity)]  # no slot left for its next step
    elif case == "slots too wide":  # an attention that reads the whole buffer: a copy trims it
        running.reserve(4 * running.capacity)
        before = _graph_view(running)
    else:
        others = [running]
    storage = running.storage
    joined = KVCache.concatenate([running, *others], rows=[kept, *[None] * len(others)], in_place=True)
    assert joined is not running and joined.storage is not storage
    assert running.storage is storage and _graph_view(running) == before


# --- an int8 cache (`service.engines.kv_quantization`) --------------------------------------------------------

def _int8(c: KVCache) -> KVCache:
    c.keys = [k.astype(np.int8) for k in c.keys]
    c.values = [(v * 2).astype(np.int8) for v in c.values]
    return c


@pytest.mark.parametrize("limit", [None, 40])
def test_every_copy_of_an_int8_cache_stays_int8_and_holds_the_same_values(limit):
    """Buffers made for it (reserve, growth), joins (a copy, and in place), gathers and reorders keep its element
    type: an int8 cache copied into float32 storage would be read by the kernel as other bytes."""
    running = _int8(cache(3, 4))
    running.limit = limit
    running.reserve(1)
    newcomer = _int8(cache(2, 2, start=50))
    joined = KVCache.concatenate([running, newcomer], in_place=True)
    copied = KVCache.concatenate([_int8(cache(3, 4)), _int8(cache(2, 2, start=50))])
    for c in (joined, copied):
        assert all(a.dtype == np.int8 for a in (*c.keys, *c.values))
    assert _used(joined, 3) == [50, 51] and _used(joined, 0) == [0, 1, 2, 3]
    joined.select(np.array([4, 0, 0]))  # a gather of most rows, repeats
    assert joined.keys[0].dtype == np.int8 and _used(joined, 0) == [52, 53] and _used(joined, 2) == [0, 1, 2, 3]
    capacity = joined.capacity
    for _ in range(capacity):  # past the capacity: a growth
        joined.open_slot()
        joined.advance()
    assert joined.capacity > capacity and _used(joined, 0)[:2] == [52, 53]
    assert all(a.dtype == np.int8 for a in (*joined.keys, *joined.values))
