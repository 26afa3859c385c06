"""The KV cache kept on the provider's device (`service.engines.device_cache`, `device_ops`), run here on the CPU
provider with CPU OrtValues: its three device graphs against numpy, and the released GPT and translator decoding
on it, in-place and concatenating graphs alike, bit-identical to the host cache through joins, reorders and
departures, with no KV byte bound in host memory; the service picks the residence per provider and reports it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from service.engines.device_cache import DeviceKVCache
from service.engines.device_ops import DeviceOps, Placement
from service.engines.gpt import GPTEngine
from service.engines.kv_cache import KVCache
from service.engines.runtime import (CPU, CUDA, RuntimeOptions, create_session, device_ops_for,
                                     kv_resident_on_device)
from service.engines.translation import TranslationEngine
from service.repository import ModelRepository
from service.settings import Settings
from tests.support import ROOT

RELEASE = ROOT / "model_repository"
RESIDENCES = ("host", "device")
JOIN, SWAP, DROP, PICK = 3, 6, 9, 12  # the steps at which a batch changes (`_decode`)
STEPS = 15


@pytest.fixture(scope="module")
def ops() -> DeviceOps:
    return DeviceOps([CPU], Placement())


def _values(ops, arrays):
    return [ops.placement.upload(a) for a in arrays]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
def test_the_device_graphs_gather_window_and_concatenate_as_numpy_does(ops, dtype):
    rng = np.random.default_rng(0)
    arrays = [(rng.standard_normal((3, 2, 5, 4)) * 50).astype(dtype) for _ in range(4)]
    values = _values(ops, arrays)
    rows = np.array([2, 0, 0, 1])
    for got, want in zip(ops.gather(values, rows), arrays):
        np.testing.assert_array_equal(got.numpy(), want[rows])
    for got, want in zip(ops.window(values, 1, 4, 2, 3), arrays):
        expected = np.pad(want[:, :, 1:4], [(0, 0), (0, 0), (2, 3), (0, 0)])
        assert got.numpy().dtype == dtype
        np.testing.assert_array_equal(got.numpy(), expected)
    others = [a[:1] for a in arrays]
    for got, a, b in zip(ops.concat([values, _values(ops, others)]), arrays, others):
        np.testing.assert_array_equal(got.numpy(), np.concatenate([a, b]))
    assert [v.numpy().tolist() for v in ops.concat([values])] == [a.tolist() for a in arrays]  # one part: as is
    for value, array in zip(values, arrays):  # inputs are left as they were
        np.testing.assert_array_equal(value.numpy(), array)


def _pair(ops, rows, slots, seed):
    """The same exact-storage cache on the host and on the device: random keys/values, each row's slots from 0."""
    rng = np.random.default_rng(seed)
    layers = [rng.standard_normal((rows, 2, slots, 3)).astype(np.float32) for _ in range(4)]
    lengths = rng.integers(1, slots + 1, rows)
    mask = (np.arange(slots) < lengths[:, None]).astype(np.int64)
    for layer in layers:
        layer *= mask[:, None, :, None]
    host = KVCache(layers[:2], layers[2:], mask.copy(), lengths.copy())
    device = DeviceKVCache(_values(ops, layers[:2]), _values(ops, layers[2:]), mask.copy(), lengths.copy(), ops)
    return host, device


def _assert_same(host: KVCache, device: DeviceKVCache):
    """The same rows, slots in use, mask and positions, and keys/values over every slot in use."""
    assert device.rows == host.rows and device.length == host.length and device.buffered == host.buffered
    used = host.length
    np.testing.assert_array_equal(device.mask[:, :used], host.mask[:, :used])
    assert not device.mask[:, used:].any() and not host.mask[:, used:].any()
    np.testing.assert_array_equal(device.positions, host.positions)
    if host.buffered:
        np.testing.assert_array_equal(device.lengths, host.lengths)
    for got, want in zip(device.tensors, [*host.keys, *host.values]):
        np.testing.assert_array_equal(got.numpy()[:, :, :used], want[:, :, :used])


@pytest.mark.parametrize("buffered", [False, True])
def test_a_device_cache_keeps_the_host_caches_rows_and_slots_through_every_operation(ops, buffered):
    host, device = _pair(ops, 3, 5, seed=1)
    if buffered:
        host.reserve(4), device.reserve(4)
        assert device.capacity >= device.length + 4
        _assert_same(host, device)
        slots = host.open_slot()
        np.testing.assert_array_equal(device.open_slot(), slots)
        host.advance(), device.advance()
        _assert_same(host, device)
    for rows in ([2, 0, 1], [1, 1, 1], [2, 0]):  # a reorder, beams from one parent, a departure
        host.select(np.array(rows)), device.select(np.array(rows))
        _assert_same(host, device)
    other_host, other_device = _pair(ops, 2, 7, seed=2)
    if buffered:
        other_host.reserve(1), other_device.reserve(1)
    joined_host = KVCache.concatenate([host, other_host], rows=[None, np.array([1])], in_place=True)
    joined_device = DeviceKVCache.concatenate([device, other_device], rows=[None, np.array([1])])
    _assert_same(joined_host, joined_device)
    none = DeviceKVCache.concatenate([joined_device], rows=[np.array([], np.int64)])
    assert none.rows == 0 and none.keys[0].shape()[0] == 0


def test_a_device_cache_refuses_to_become_buffers_from_unaligned_rows(ops):
    _, device = _pair(ops, 2, 4, seed=3)
    device.mask[0] = [0, 1, 1, 0]  # a left-padded row
    with pytest.raises(ValueError, match="from slot 0"):
        device.reserve(1)


def _version(tmp_path, kind: str, step_graph: bool | None):
    """The released version of `kind`, with its stored graphs, or a copy without the in-place step graph (False)
    or with one added (True)."""
    released = ModelRepository(RELEASE).get(kind)
    if step_graph is None:
        return released
    root = tmp_path / kind / str(released.version)
    shutil.copytree(released.path, root)
    config = json.loads((root / "config.json").read_text())
    if step_graph:
        from export.kv_inplace import add_step_graph

        add_step_graph(root, config)
    else:
        config["files"].pop("decoder_step")
    (root / "config.json").write_text(json.dumps(config))
    return ModelRepository(tmp_path).get(kind)


def _decode(engine, inputs, candidates: int = 0):
    """Greedy steps over a batch that others join (JOIN), whose rows swap (SWAP), lose one (DROP) and take some
    rows of another (PICK) -> every step's logits."""
    step_kwargs = {"candidates": candidates} if candidates else {}

    def logits_of(out):
        return out.logits if candidates else out

    first, state = engine.prefill(inputs[:2], **step_kwargs)
    seen, tokens = [logits_of(first)], logits_of(first).argmax(-1)
    for step in range(STEPS):
        if step in (JOIN, PICK):
            more, joining = engine.prefill(inputs[2:], **step_kwargs)
            kept = None if step == JOIN else np.array([len(inputs) - 3, 0])
            state = engine.concatenate([state, joining], rows=[None, kept])
            extra = logits_of(more).argmax(-1)
            tokens = np.concatenate([tokens, extra if kept is None else extra[kept]])
        if step == SWAP:
            order = np.array([2, 1, 0, *range(3, len(tokens))])
            state, tokens = engine.select(state, order), tokens[order]
        if step == DROP:
            state, tokens = engine.select(state, np.arange(1, len(tokens))), tokens[1:]
        out = engine.step(state, tokens, **step_kwargs)
        seen.append(logits_of(out))
        tokens = logits_of(out).argmax(-1)
    return seen


def _transfers_per_step(engine) -> tuple[float, float]:
    t = engine.transfers
    return t.kv_bytes / t.steps, t.other_bytes / t.steps


@pytest.mark.parametrize("step_graph", [None, False], ids=["in-place", "concatenating"])
def test_the_gpt_decodes_bit_identically_with_its_cache_on_the_device(tmp_path, step_graph):
    model = _version(tmp_path, "gpt", step_graph)
    prompts = [list(b"ROMEO:"), list(b"To be, or not"), list(b"A"), list(b"KING HENRY:\nNo")]
    engines = {r: GPTEngine(model, RuntimeOptions(kv_residence=r, weights="fp32")) for r in RESIDENCES}
    assert {r: e.kv_residence for r, e in engines.items()} == {r: r for r in RESIDENCES}
    host, device = (_decode(engines[r], prompts) for r in RESIDENCES)
    assert len(host) == len(device) == STEPS + 1
    for want, got in zip(host, device):
        np.testing.assert_array_equal(got, want)
    host_kv, host_other = _transfers_per_step(engines["host"])
    device_kv, device_other = _transfers_per_step(engines["device"])
    assert device_kv == 0 and host_kv > 10 * device_other  # the host cache is bound whole, every step
    assert 0 < device_other <= host_other


@pytest.mark.parametrize("step_graph", [None, True], ids=["concatenating", "in-place"])
def test_the_translator_decodes_bit_identically_with_its_cache_and_sources_on_the_device(tmp_path, step_graph):
    model = _version(tmp_path, "translation", step_graph)
    engines = {r: TranslationEngine(model, RuntimeOptions(kv_residence=r)) for r in RESIDENCES}
    texts = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee auf einer Wiese.", "Eine Frau liest.",
             "Kinder laufen am Strand."]
    sources = [engines["host"].source_ids(t) for t in texts]
    host, device = (_decode(engines[r], sources, candidates=4) for r in RESIDENCES)
    for want, got in zip(host, device):
        np.testing.assert_array_equal(got, want)
    assert _transfers_per_step(engines["device"])[0] == 0 < _transfers_per_step(engines["host"])[0]
    # scoring feeds its own host encoding: the same scores whichever residence decodes
    scored = [engines[r].score_ids(sources[:2], [[5, 6, 7], [8]], [0, 1]) for r in RESIDENCES]
    for want, got in zip(*scored):
        np.testing.assert_array_equal(got, want)


def test_the_residence_follows_the_provider_unless_set():
    assert not kv_resident_on_device(RuntimeOptions(), CPU)  # numpy by address is faster on the CPU provider
    assert kv_resident_on_device(RuntimeOptions(), CUDA)
    assert kv_resident_on_device(RuntimeOptions(kv_residence="device"), CPU)
    assert not kv_resident_on_device(RuntimeOptions(kv_residence="host"), CUDA)
    with pytest.raises(ValueError, match="kv_residence must be one of auto, device, host"):
        kv_resident_on_device(RuntimeOptions(kv_residence="gpu"), CPU)
    session = create_session(RELEASE / "vit" / "4" / "model.onnx", RuntimeOptions(device="cpu"))
    assert device_ops_for(session, RuntimeOptions()) is None
    ops = device_ops_for(session, RuntimeOptions(kv_residence="device"))
    assert ops.placement == Placement("cpu", 0) and [name for name, _ in ops.providers] == [CPU]


def test_an_int8_cache_stays_on_the_host_where_it_is_quantised():
    engine = GPTEngine(ModelRepository(RELEASE).get("gpt"), RuntimeOptions(kv_residence="device",
                                                                           weights="int8+gqa+kv8"))
    assert engine.kv_residence == "host"


def test_the_service_reports_the_residence_and_serves_the_same_text_from_a_device_cache(serving):
    bodies = {"/v1/generate": {"prompt": "ROMEO:\nWhat", "max_new_tokens": 24, "temperature": 0},
              "/v1/translate": {"text": "Ein Mann fährt Fahrrad.", "num_beams": 4, "max_new_tokens": 20}}
    answers = {}
    for residence in RESIDENCES:
        settings = Settings(repository=RELEASE, models=["gpt", "translation"], variant="stored",
                            kv_residence=residence)
        with serving(settings) as client:
            models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
            assert {models[n]["variant"]["kv_residence"] for n in ("gpt", "translation")} == {residence}
            answers[residence] = {path: client.post(path, json=body).json() for path, body in bodies.items()}
    assert answers["device"] == answers["host"]
