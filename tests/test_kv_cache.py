"""KVCache row bookkeeping: select (reorder, repeat, drop), trim and concatenate, table-style."""

import numpy as np
import pytest

from service.kv_cache import CAPACITY_STEP, KVCache, capacity_for


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


def test_bad_row_indices_are_an_error():
    with pytest.raises(IndexError):
        cache(2, 2).select(np.array([0, 5, 1]))


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
        assert c.open_slot() == c.length
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


def test_buffers_select_and_concatenate_like_exact_storage():
    exact = KVCache.concatenate([cache(1, 2), cache(2, 4, start=10)])
    merged = KVCache.concatenate([buffered(1, 2), buffered(2, 4, start=10)])
    assert merged.buffered and merged.length == exact.length and merged.capacity > merged.length
    assert merged.mask[:, : merged.length].tolist() == exact.mask.tolist()
    assert merged.keys[0][:, :, : merged.length].tolist() == exact.keys[0].tolist()
    for rows in ([2, 2, 0], [1, 2]):  # in place, then a gather that drops the longest rows' leading slots
        exact.select(np.array(rows))
        merged.select(np.array(rows))
        assert merged.buffered and merged.length == exact.length
        assert merged.keys[0][:, :, : merged.length].tolist() == exact.keys[0].tolist()
        assert merged.mask[:, : merged.length].tolist() == exact.mask.tolist()
        assert merged.first_used_slot() == exact.first_used_slot()
