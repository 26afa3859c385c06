"""The calibration cache read when a version loads (`service.models.calibration.CalibrationCache`): a file or an entry
that is not a valid measurement for this host (damaged timings, missing fields, another host's, not JSON, not an
object, nested past the recursion limit) is ignored with one log line naming the file and the reason, the version is
measured again and the cache rewritten with a valid entry; never an error that keeps the model from loading."""

from __future__ import annotations

import json
import logging
import math

import pytest

from service.engines.runtime import RuntimeOptions
from service.models import variants as V
from service.models.calibration import MAX_CACHE_BYTES, MAX_REASON_CHARS, CalibrationCache, calibration_key, key_hash
from service.models.kinds import KIND_TABLE

ROWS = (1, 4)  # batch sizes calibrated here: small, so that the tiny model's measurements take milliseconds
LOGGER = "service.models.calibration"
NESTING = 200_000  # far past Python's recursion limit


@pytest.fixture(scope="module")
def valid(gpt_with_int8, tmp_path_factory) -> dict:
    """The cache file (parsed) a measuring start writes for the tiny GPT on this host."""
    path = tmp_path_factory.mktemp("valid-cache") / "calibration.json"
    _, choice = V.load_engine(gpt_with_int8, KIND_TABLE["gpt"], RuntimeOptions(), V.AUTO, ROWS, CalibrationCache(path))
    assert choice.chosen_by == V.MEASURED
    return json.loads(path.read_text())


def _load(model, path, caplog):
    """Load the version with the cache at `path`; its choice and the calibration module's log lines."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _, choice = V.load_engine(model, KIND_TABLE["gpt"], RuntimeOptions(), V.AUTO, ROWS, CalibrationCache(path))
    return choice, [r for r in caplog.records if r.name == LOGGER]


def _entry(entries: dict) -> dict:
    (entry,) = entries.values()
    return entry


def _drop(mapping: dict, key: str) -> None:
    del mapping[key]


# each: how the entry for this host is damaged, and what the log line says of it
DAMAGED_ENTRIES = {
    "timing 0": (lambda e: e["timings"]["int8"].update({"1": 0}), "timings.int8.1: Input should be greater than 0"),
    "negative timing": (lambda e: e["timings"]["int8"].update({"1": -0.5}), "greater than 0"),
    "NaN timing": (lambda e: e["timings"]["int8"].update({"1": math.nan}), "finite number"),
    "infinite timing": (lambda e: e["timings"]["fp32"].update({"4": math.inf}), "timings.fp32.4: Input should be a "
                        "finite number"),
    "timing as text": (lambda e: e["timings"]["int8"].update({"1": "0.001"}), "valid number"),
    "timing true": (lambda e: e["timings"]["int8"].update({"1": True}), "valid number"),
    "a row count missing": (lambda e: _drop(e["timings"]["int8"], "4"),
                            "timings.int8 has the batch sizes [1], not [1, 4]"),
    "a row count more": (lambda e: e["timings"]["int8"].update({"64": 0.1}), "batch sizes [1, 4, 64], not [1, 4]"),
    "a row count not a number": (lambda e: e["timings"]["int8"].update({"many": 0.1}), "valid integer"),
    "no timings": (lambda e: _drop(e, "timings"), "timings: Field required"),
    "empty timings": (lambda e: e.update(timings={}), "timings: Dictionary should have at least 1 item"),
    "timings a list": (lambda e: e.update(timings=[[0.1]]), "timings: Input should be a valid dictionary"),
    "the stored variant untimed": (lambda e: _drop(e["timings"], "fp32"), "the stored one (the first of ['fp32', 'int8']) must be timed"),
    "a variant not offered": (lambda e: e["timings"].update(fp16=e["timings"]["fp32"]), "no other than those offered"),
    "no measured_at": (lambda e: _drop(e, "measured_at"), "measured_at: Field required"),
    "measured_at not a time": (lambda e: e.update(measured_at="yesterday"), "measured_at: String should match"),
    "measured_at a number": (lambda e: e.update(measured_at=1700000000), "measured_at: Input should be a valid string"),
    "an unknown field": (lambda e: e.update(note="x"), "note: Extra inputs are not permitted"),
    "another host's key": (lambda e: e["key"].update(cpu="Some Other CPU"),
                           "measured elsewhere (cpu 'Some Other CPU', here "),
    "no key": (lambda e: _drop(e, "key"), "key: Field required"),
}


@pytest.mark.parametrize("damage, reason", DAMAGED_ENTRIES.values(), ids=DAMAGED_ENTRIES)
def test_a_damaged_entry_is_ignored_with_its_reason_and_measured_again(gpt_with_int8, valid, tmp_path, caplog,
                                                                        damage, reason):
    entries = json.loads(json.dumps(valid))
    damage(_entry(entries))
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(entries))  # NaN and Infinity as Python's json writes them
    choice, records = _load(gpt_with_int8, path, caplog)
    assert choice.chosen_by == V.MEASURED
    assert all(math.isfinite(s) and s > 0 for by_rows in choice.timings.values() for s in by_rows.values())
    (record,) = records
    message = record.getMessage()
    assert record.levelno == logging.WARNING and str(path) in message and "gpt:1" in message, message
    assert "not a valid measurement" in message and reason in message, message
    _assert_rewritten(gpt_with_int8, path, caplog)


def _assert_rewritten(model, path, caplog) -> None:
    """The cache now holds a valid entry for this host: the next start reads it, silently."""
    choice, records = _load(model, path, caplog)
    assert choice.chosen_by == V.CACHED and records == []


# each: the whole file, and what the log line says of it
UNUSABLE_FILES = {
    "not JSON": (b"{not json", "it is not JSON: Expecting property name"),
    "empty": (b"", "it is not JSON: Expecting value (character 0)"),
    "nested 200k deep": (b"[" * NESTING, "it is not JSON: it is nested too deeply"),
    "nested 200k deep in an entry": (b'{"x": ' + b"[" * NESTING, "it is not JSON: it is nested too deeply"),
    "not UTF-8": (b'{"\xff": 1}', "it is not JSON: it is not UTF-8"),
    "a list": (b"[]", "it is a JSON list, not an object of entries"),
    "null": (b"null", "it is a JSON NoneType, not an object of entries"),
    "a number": (b"1e999", "it is a JSON float, not an object of entries"),
}


@pytest.mark.parametrize("content, reason", UNUSABLE_FILES.values(), ids=UNUSABLE_FILES)
def test_a_file_that_is_not_a_cache_is_ignored_with_its_reason_and_replaced(gpt_with_int8, tmp_path, caplog, content,
                                                                            reason):
    path = tmp_path / "calibration.json"
    path.write_bytes(content)
    choice, records = _load(gpt_with_int8, path, caplog)
    assert choice.chosen_by == V.MEASURED
    (record,) = records
    message = record.getMessage()
    assert record.levelno == logging.WARNING and str(path) in message and reason in message, message
    _assert_rewritten(gpt_with_int8, path, caplog)


def test_a_file_larger_than_any_cache_is_not_read(gpt_with_int8, tmp_path, caplog):
    path = tmp_path / "calibration.json"
    with path.open("wb") as f:
        f.truncate(MAX_CACHE_BYTES + 1)  # sparse: no disk space taken
    choice, (record,) = _load(gpt_with_int8, path, caplog)
    assert choice.chosen_by == V.MEASURED and f"more than the {MAX_CACHE_BYTES}" in record.getMessage()


def test_another_hosts_cache_is_measured_again_saying_where_it_differs(gpt_with_int8, valid, tmp_path, caplog):
    """A cache shared from another kind of host (another CPU): no entry of this host, and the log says which of the
    key's fields differ; the other host's entry stays."""
    entry = json.loads(json.dumps(_entry(valid)))
    entry["key"].update(cpu="AMD EPYC 9654 96-Core Processor", isa=["avx", "avx2"])
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({key_hash(entry["key"]): entry}))
    choice, (record,) = _load(gpt_with_int8, path, caplog)
    message = record.getMessage()
    assert choice.chosen_by == V.MEASURED and record.levelno == logging.INFO and str(path) in message
    assert "no entry for this host" in message and "cpu 'AMD EPYC 9654 96-Core Processor', here " in message
    assert "isa ['avx', 'avx2'], here " in message and "graphs" not in message
    assert len(json.loads(path.read_text())) == 2  # both hosts' entries
    _assert_rewritten(gpt_with_int8, path, caplog)


@pytest.mark.parametrize("entries, reason", [
    (None, "there is no such file yet"), ({}, "it has no entry for this version"),
    ({"0" * 16: {"key": {"model": "vit:1"}}}, "it has no entry for this version"),
])
def test_a_cache_without_an_entry_says_so(gpt_with_int8, tmp_path, caplog, entries, reason):
    path = tmp_path / "calibration.json"
    if entries is not None:
        path.write_text(json.dumps(entries))
    choice, (record,) = _load(gpt_with_int8, path, caplog)
    assert choice.chosen_by == V.MEASURED and record.levelno == logging.INFO
    assert record.getMessage().endswith(f"not used for gpt:1 ({reason}): measuring")


def test_the_reason_in_the_log_line_is_bounded(gpt_with_int8, valid, tmp_path, caplog):
    entries = json.loads(json.dumps(valid))
    _entry(entries)["key"]["cpu"] = "x" * 100_000
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(entries))
    _, (record,) = _load(gpt_with_int8, path, caplog)
    assert len(record.getMessage()) < MAX_REASON_CHARS + len(str(path)) + 100


def test_the_key_names_the_variants_offered(gpt_with_int8):
    """Offering another variant is another measurement: the key (and its entry) changes."""
    key = calibration_key(gpt_with_int8, "CPUExecutionProvider", RuntimeOptions(), ROWS, ("fp32", "int8"))
    assert key["offered"] == ["fp32", "int8"]
    assert key_hash(key) != key_hash(calibration_key(gpt_with_int8, "CPUExecutionProvider", RuntimeOptions(), ROWS,
                                                     ("fp32", "int8", "int8+gqa")))
