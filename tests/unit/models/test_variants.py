"""Which weights variant a version runs (`service.models.variants`) and the calibration behind the choice
(`service.models.calibration`): only checked variants are candidates, the fastest by the geometric mean of its
slowdowns wins (the stored one unless beaten by more than the margin), a pin overrides and says so, measurements
are cached per host and reused (a cache that is not a valid measurement: tests/unit/models/test_calibration_cache.py),
and the engine that serves really computes with the chosen weights."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest

from service.engines.gpt import GPTEngine
from service.engines.runtime import CPU, CUDA, RuntimeOptions
from service.engines.weights import ALL_VARIANTS
from service.models import variants as V
from service.models.calibration import ROUNDS_BESIDE, CalibrationCache, calibration_key, cpu_identity
from service.models.kinds import KIND_TABLE
from service.repository import ModelVersion
from service.settings import Settings

ROWS = (1, 4)  # batch sizes calibrated here: small, so that the tiny model's measurements take milliseconds
PROMPT = [5, 6, 7]


@pytest.mark.parametrize("spec, pins", [
    ("auto", {"*": "auto"}), ("", {}), ("stored", {"*": "stored"}), ("int8", {"*": "int8"}),
    ("gpt=fp32, translation=stored", {"gpt": "fp32", "translation": "stored"}),
    ("fp32,vit=int8", {"*": "fp32", "vit": "int8"}), ("fp16", {"*": "fp16"}), ("gpt=fp16+gqa", {"gpt": "fp16+gqa"}),
])
def test_pins_parse(spec, pins):
    assert V.parse_pins(spec) == pins
    assert V.pin_for(pins, "vit") == pins.get("vit", pins.get("*", "auto"))


@pytest.mark.parametrize("spec", ["fp8", "gpt=fp16+gqa+kv8", "=int8", "gpt=int8,gpt=fp32", "int8,fp32"])
def test_bad_pins_name_the_entry(spec):
    with pytest.raises(ValueError, match="bad TSERVE_VARIANT entry"):
        V.parse_pins(spec)
    with pytest.raises(ValueError, match="TSERVE_VARIANT"):
        Settings(variant=spec)


@pytest.mark.parametrize("config, expected", [
    ({"weights": "int8", "variants": {"fp32": {"measured": 1.47}}}, ("int8", "fp32")),
    ({"weights": "fp16", "variants": {"int8": {"measured": 37.9}}}, ("fp32", "int8")),  # fp16 storage: fp32
    ({"weights": "int8"}, ("int8",)),
    ({}, ("fp32",)),  # the first exports: float32, nothing checked
    ({"weights": "fp32", "variants": {"int8": "not a check"}}, ("fp32",)),
])
def test_a_version_offers_its_stored_variant_and_the_checked_ones(tmp_path, config, expected):
    assert V.offered(ModelVersion("m", 1, tmp_path, {"kind": "gpt", **config}), CPU) == expected


CHECKED = {v: {"measured": 1.43} for v in ("fp32", "fp32+gqa", "int8+gqa", "fp32+gqa+kv8")}


@pytest.mark.parametrize("config, provider, expected", [
    # CPU: the checked ones; CUDA: no float32 GroupQueryAttention, the float16 ones instead
    ({"weights": "int8", "variants": CHECKED}, CPU, ("int8", "fp32", "fp32+gqa", "int8+gqa", "fp32+gqa+kv8")),
    ({"weights": "int8", "variants": CHECKED}, CUDA, ("int8", "fp32", "fp16", "fp16+gqa")),
    # no checked +gqa variant (a translator, or a failed check): its step rewrite is unchecked, fp16 alone
    ({"weights": "fp16", "variants": {"int8": {"measured": 37.9}}}, CUDA, ("fp32", "int8", "fp16")),
    ({}, CUDA, ("fp32", "fp16")),
    ({}, "FakeExecutionProvider", ("fp32",)),  # float16 on CUDA only
])
def test_what_a_version_offers_is_a_function_of_its_config_and_the_provider(tmp_path, config, provider, expected):
    model = ModelVersion("m", 1, tmp_path, {"kind": "gpt", **config})
    assert V.offered(model, provider) == expected
    refused = V.not_offered(model, provider)
    assert set(refused) | set(expected) == set(ALL_VARIANTS) and not set(refused) & set(expected)


def test_what_is_not_offered_says_why(tmp_path):
    model = ModelVersion("m", 1, tmp_path, {"kind": "gpt", "weights": "int8", "variants": CHECKED})
    on_cpu, on_cuda = V.not_offered(model, CPU), V.not_offered(model, CUDA)
    unchecked_rows = {v: V.NOT_CHECKED for v in ("int8rows", "int8rows+gqa", "int8rows+gqa+kv8")}
    assert on_cpu == {"fp16": V.CPU_FLOAT16, "fp16+gqa": V.CPU_FLOAT16, "int8+gqa+kv8": V.NOT_CHECKED,
                      **unchecked_rows}
    assert on_cuda == {"fp32+gqa": V.CUDA_FLOAT_GQA, "int8+gqa": V.CUDA_FLOAT_GQA, "fp32+gqa+kv8": V.CUDA_FLOAT_GQA,
                       "int8+gqa+kv8": V.CUDA_FLOAT_GQA, "int8rows": V.CUDA_INTEGER_GEMM,
                       "int8rows+gqa": V.CUDA_INTEGER_GEMM, "int8rows+gqa+kv8": V.CUDA_INTEGER_GEMM}
    # the provider's reason comes first
    plain = ModelVersion("m", 1, tmp_path, {"kind": "translation", "weights": "fp32"})
    assert V.not_offered(plain, CUDA)["fp16+gqa"] == V.NO_STEP_REWRITE
    assert V.provider_limit("int8", CUDA) is None  # 8-bit MatMulNBits has CUDA kernels (ONNX Runtime >= 1.22)
    assert "CUDA" in V.provider_limit("fp16", "FakeExecutionProvider")


@pytest.mark.parametrize("timings, stored, chosen", [
    ({"int8": {1: 1.0, 64: 1.0}, "fp32": {1: 0.8, 64: 0.9}}, "int8", "fp32"),  # faster at both sizes
    ({"int8": {1: 1.0, 64: 1.0}, "fp32": {1: 0.98, 64: 0.97}}, "int8", "int8"),  # within the margin: stored
    ({"int8": {1: 1.0, 64: 2.0}, "fp32": {1: 2.0, 64: 1.0}}, "int8", "int8"),  # a tie of slowdowns: stored
    ({"int8": {1: 1.0, 64: 1.0}, "fp32": {1: 1.5, 64: 0.5}}, "fp32", "fp32"),  # slowdowns 1.22 vs 1.41
    ({"int8": {1: 1.0, 64: 1.0}, "fp32": {1: 1.2, 64: 0.5}}, "int8", "fp32"),  # 1.10 vs 1.41: derived wins
    ({"int8": {1: 1.0, 64: 1.0}, "fp32": {1: 2.0, 64: 0.6}}, "fp32", "int8"),  # 1.41 vs 1.29: derived wins
])
def test_the_fastest_by_the_geometric_mean_of_slowdowns_wins_the_stored_one_within_the_margin(timings, stored,
                                                                                            chosen):
    assert V.fastest(timings, stored) == chosen


def _counting(kind):
    """The kind with its calibration workload counted."""
    calls = []

    def workload(engine, rows):
        calls.append((engine.options_weights, rows))
        return kind.calibration(engine, rows)

    class Engine(kind.engine):
        def __init__(self, model, options):
            super().__init__(model, options)
            self.options_weights = options.weights

    return dataclasses.replace(kind, engine=Engine, calibration=workload), calls


def _logits(engine):
    return engine.prefill([PROMPT])[0]


def test_auto_measures_every_offered_variant_chooses_caches_and_serves_the_choice(gpt_with_int8, tmp_path):
    kind, calls = _counting(KIND_TABLE["gpt"])
    cache = CalibrationCache(tmp_path / "cache" / "calibration.json")
    engine, choice = V.load_engine(gpt_with_int8, kind, RuntimeOptions(), V.AUTO, ROWS, cache)
    assert choice.chosen_by == V.MEASURED and choice.offered == ("fp32", "int8") and choice.stored == "fp32"
    assert set(choice.timings) == {"fp32", "int8"} and all(set(t) == set(ROWS) for t in choice.timings.values())
    assert all(s > 0 for t in choice.timings.values() for s in t.values())
    assert choice.weights == V.fastest(choice.timings, "fp32") and engine.options_weights == choice.weights
    # beside the stored one (`measure_against`): one untimed and ROUNDS_BESIDE timed runs of each at each size (and
    # the derived one's first run, at 1 row)
    runs = 1 + ROUNDS_BESIDE
    assert sorted(calls) == sorted([(w, r) for w in ("fp32", "int8") for r in ROWS] * runs + [("int8", 1)])
    assert cpu_identity()["cpu"] in choice.reason and "measured" in choice.reason
    # the engine computes with the chosen weights: its logits are those of an engine built with them alone
    np.testing.assert_array_equal(_logits(engine),
                                  _logits(GPTEngine(gpt_with_int8, RuntimeOptions(weights=choice.weights))))
    assert not np.array_equal(_logits(GPTEngine(gpt_with_int8, RuntimeOptions(weights="fp32"))),
                              _logits(GPTEngine(gpt_with_int8, RuntimeOptions(weights="int8"))))

    calls.clear()  # a restart on the same host: the cached timings, nothing measured
    again, cached = V.load_engine(gpt_with_int8, kind, RuntimeOptions(), V.AUTO, ROWS, cache)
    assert cached.chosen_by == V.CACHED and cached.timings == choice.timings and calls == []
    assert cached.weights == choice.weights and again.options_weights == choice.weights
    entry = next(iter(json.loads(cache.path.read_text()).values()))
    assert entry["key"] == calibration_key(gpt_with_int8, "CPUExecutionProvider", RuntimeOptions(), ROWS,
                                           ("fp32", "int8"))

    calls.clear()  # other batch sizes (another TSERVE_GPT_MAX_BATCH_ROWS): measured again
    _, other = V.load_engine(gpt_with_int8, kind, RuntimeOptions(), V.AUTO, (1, 2), cache)
    assert other.chosen_by == V.MEASURED and calls


def test_changed_graphs_are_measured_again(gpt_with_int8, tmp_path):
    kind, calls = _counting(KIND_TABLE["gpt"])
    cache = CalibrationCache(tmp_path / "calibration.json")
    V.load_engine(gpt_with_int8, kind, RuntimeOptions(), V.AUTO, ROWS, cache)
    graph = gpt_with_int8.path / "decoder.onnx"
    graph.write_bytes(graph.read_bytes())  # rewritten, the same bytes: the same digest, still cached
    calls.clear()
    assert V.load_engine(gpt_with_int8, kind, RuntimeOptions(), V.AUTO, ROWS, cache)[1].chosen_by == V.CACHED
    key = calibration_key(gpt_with_int8, "CPUExecutionProvider", RuntimeOptions(), ROWS, ("fp32", "int8"))
    assert cache.get(key) is not None
    assert cache.get({**key, "graphs": "0" * 64}) is None  # another graph (or CPU, threads, runtime): no entry
    for options in (RuntimeOptions(single_thread_rows=4), RuntimeOptions(fuse_projections=False)):
        # the session options that change the timings are part of the key
        assert calibration_key(gpt_with_int8, "CPUExecutionProvider", options, ROWS, ("fp32", "int8")) != key


def test_a_pin_runs_its_variant_unmeasured_and_an_unchecked_pin_says_so(gpt_with_int8, tmp_path, caplog):
    kind, calls = _counting(KIND_TABLE["gpt"])
    cache = CalibrationCache(tmp_path / "calibration.json")
    engine, choice = V.load_engine(gpt_with_int8, kind, RuntimeOptions(), "int8", ROWS, cache)
    assert (choice.weights, choice.chosen_by, engine.options_weights, calls) == ("int8", V.PINNED, "int8", [])
    assert choice.reason == "pinned by TSERVE_VARIANT (int8)" and not cache.path.exists()
    _, stored = V.load_engine(gpt_with_int8, kind, RuntimeOptions(), V.STORED, ROWS, cache)
    assert stored.weights == "fp32" and stored.chosen_by == V.PINNED

    plain = ModelVersion("gpt", 1, gpt_with_int8.path, {**gpt_with_int8.config, "variants": {}})
    with caplog.at_level(logging.WARNING, logger="service.models.variants"):
        _, unchecked = V.load_engine(plain, kind, RuntimeOptions(), "int8", ROWS, cache)
    assert unchecked.weights == "int8" and f"does not offer it on {CPU}: {V.NOT_CHECKED}" in unchecked.reason
    assert "not offered" in caplog.text and unchecked.not_offered["int8"] == V.NOT_CHECKED
    _, only = V.load_engine(plain, kind, RuntimeOptions(), V.AUTO, ROWS, cache)
    assert (only.weights, only.chosen_by, calls) == ("fp32", V.ONLY, [])
    assert only.not_offered["fp16"] == V.CPU_FLOAT16


def test_a_pinned_float16_variant_runs_on_the_cpu_with_the_reason_it_is_not_offered(gpt_with_int8, tmp_path, caplog):
    """ONNX Runtime's CPU provider runs a float16 graph (casting most ops to float32): a pin is an override."""
    kind, _ = _counting(KIND_TABLE["gpt"])
    with caplog.at_level(logging.WARNING, logger="service.models.variants"):
        engine, choice = V.load_engine(gpt_with_int8, kind, RuntimeOptions(device="cpu"), "fp16", ROWS,
                                       CalibrationCache(None))
    assert (choice.weights, choice.chosen_by, engine.options_weights) == ("fp16", V.PINNED, "fp16")
    assert V.CPU_FLOAT16 in choice.reason and "fp16" not in choice.offered and "not offered" in caplog.text
    fp32 = _logits(GPTEngine(gpt_with_int8, RuntimeOptions(weights="fp32")))
    np.testing.assert_allclose(_logits(engine), fp32, atol=0.05 * np.abs(fp32).max())  # float16-rounded weights


def test_the_service_reports_the_choice_and_the_measurements(gpt_with_int8, serving, tmp_path):
    settings = Settings(repository=gpt_with_int8.path.parents[1], variant="auto", gpt_max_batch_rows=4,
                        calibration_cache=str(tmp_path / "calibration.json"))
    with serving(settings) as client:
        model = next(m for m in client.get("/v1/models").json()["data"] if m["id"] == "gpt")
        metrics = client.get("/metrics").text
    variant = model["variant"]
    assert variant["chosen_by"] == V.MEASURED and variant["offered_weights"] == "fp32,int8"
    assert variant["not_offered"]["fp16"] == V.CPU_FLOAT16
    assert variant["weights"] in ("fp32", "int8") and variant["stored_weights"] == "fp32"
    assert "per token at 1/4 rows" in variant["reason"]
    for weights in ("fp32", "int8"):
        for rows in ("1", "4"):
            assert f'tserve_variant_seconds{{model="gpt",rows="{rows}",version="1",weights="{weights}"}}' in metrics
    assert 'chosen_by="measured"' in metrics and f'weights="{variant["weights"]}"' in metrics


def test_the_explicit_calibration_step_fills_the_cache_the_server_then_reads(gpt_with_int8, tmp_path, monkeypatch,
                                                                            capsys):
    from service.models.calibrate import main

    cache = tmp_path / "calibration.json"
    for name, value in {"REPOSITORY": gpt_with_int8.path.parents[1], "VARIANT": "auto", "CALIBRATION_CACHE": cache,
                        "GPT_MAX_BATCH_ROWS": 4}.items():
        monkeypatch.setenv(f"TSERVE_{name}", str(value))
    assert main(["gpt"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("gpt:1 runs ") and "(measured)" in first and str(cache) in first
    assert main([]) == 0 and "(cached measurement)" in capsys.readouterr().out  # every model: the tiny GPT
    assert main(["gpt", "--again"]) == 0 and "(measured)" in capsys.readouterr().out
    assert main(["gpt", "--pins"]) == 0  # the choice alone, as a TSERVE_VARIANT value (bench/shipped.py reads it)
    pins = capsys.readouterr().out.strip()
    from service.models.registry import runtime_options

    kind = KIND_TABLE["gpt"]  # what a server start with these settings finds
    _, choice = V.load_engine(gpt_with_int8, kind, runtime_options(Settings(), kind), V.AUTO, (1, 4),
                              CalibrationCache(cache))
    assert choice.chosen_by == V.CACHED
    assert pins == f"gpt={choice.weights}" and V.parse_pins(pins) == {"gpt": choice.weights}
    assert main(["nope"]) == 2 and "not found" in capsys.readouterr().err


def test_a_variant_that_cannot_run_here_is_no_candidate(gpt_with_int8, tmp_path, caplog):
    kind, _ = _counting(KIND_TABLE["gpt"])

    def fails_in_int8(engine, rows):  # as a provider without the int8 kernel would
        if engine.options_weights == "int8":
            raise RuntimeError("no kernel for MatMulNBits")
        return KIND_TABLE["gpt"].calibration(engine, rows)

    kind = dataclasses.replace(kind, calibration=fails_in_int8)
    cache = CalibrationCache(tmp_path / "calibration.json")
    with caplog.at_level(logging.WARNING, logger="service.models.variants"):
        engine, choice = V.load_engine(gpt_with_int8, kind, RuntimeOptions(), V.AUTO, ROWS, cache)
    assert (choice.weights, choice.chosen_by, set(choice.timings)) == ("fp32", V.MEASURED, {"fp32"})
    assert "does not run here" in caplog.text and engine.options_weights == "fp32"
    _, again = V.load_engine(gpt_with_int8, kind, RuntimeOptions(), V.AUTO, ROWS, cache)
    assert again.chosen_by == V.CACHED  # not measured again at every start


def test_the_gpt_is_timed_over_a_served_requests_length_within_its_context(gpt_with_int8, monkeypatch):
    """A GPT's variants are timed over `GPT_CALIBRATION_STEPS` generated tokens (16 ranked gpt/4's int8+gqa behind
    int8 at 64 rows where 128, what the service runs, rank it ahead), fewer where the context holds fewer, and
    every one of those steps runs."""
    from service.models import kinds

    engine = GPTEngine(gpt_with_int8, RuntimeOptions())
    prompt = engine.tokenizer.encode(kinds.GPT_CALIBRATION_PROMPT).ids
    steps = []
    original = GPTEngine.step
    monkeypatch.setattr(GPTEngine, "step", lambda self, *a: steps.append(1) or original(self, *a))
    room = engine.context_length - len(prompt)
    assert kinds.KIND_TABLE["gpt"].calibration(engine, 2) == 2 * (min(kinds.GPT_CALIBRATION_STEPS, room) + 1)
    assert len(steps) == min(kinds.GPT_CALIBRATION_STEPS, room) and room < kinds.GPT_CALIBRATION_STEPS  # tiny: 64
    monkeypatch.setattr(kinds, "GPT_CALIBRATION_STEPS", 5)
    steps.clear()
    assert kinds.KIND_TABLE["gpt"].calibration(engine, 3) == 3 * 6 and len(steps) == 5
