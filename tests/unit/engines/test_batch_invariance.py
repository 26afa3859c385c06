"""Batch invariance: a request's output is the same alone and among 15 others (greedy, beam and seeded sampling),
bit for bit, for every version whose decoder steps in place (`service.engines.kv_cache`: every row's slots from 0, so no
masked slot ever sits before a row's tokens; `export.kv_inplace`: each row writes its own slot) - the tiny GPT
converted into those variants, and the released GPT (version 3, int8 + fused attention + in-place KV); the GPTs' logits
also in their `+gqa` variants (GroupQueryAttention steps) and on the integer GEMM (`int8rows`); and with prompts that start from cached prefixes
(`service.engines.prefix_cache`): the same outputs with the cache on and off, on a miss, a hit and among others.

The released translator steps by concatenation (the in-place option costs it 4-13% of its throughput, docs/export.md);
its weights with the in-place step graph are checked per step here. Versions that step by concatenation are not
covered: a row that joins a running batch is left-padded there, and ONNX Runtime's attention reductions then group
its slots differently (last-bit changes that int8 activations can turn into another token); docs/architecture.md, "Batch
invariance". Neither is the tiny translator's in-place variant: with its head_dim of 16, masked source slots
after a source change its cross-attention's last bits (1.7e-6); the released translator's (head_dim 64) do not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from export.convert import main as convert_main
from service.repository import ModelRepository
from service.settings import Settings
from tests.support import ROOT
from tests.support.invariance import GERMAN, GPT_PROMPTS, alone_and_among_others

pytestmark = pytest.mark.slow

RELEASE_REPOSITORY = ROOT / "model_repository"
# (name, conversion arguments) -> version 2, 3, ... of the tiny model `name`
VARIANTS = [("gpt", ["--weights", "int8", "--attention", "mha", "--kv-cache", "inplace"]),
            ("gpt", ["--kv-cache", "inplace"])]
GPT_TARGETS = {
    "greedy": {"prompt": "ROMEO:\nWhat", "max_new_tokens": 40, "temperature": 0},
    "sample": {"prompt": "ROMEO:\nWhat", "max_new_tokens": 40, "temperature": 1.0, "top_p": 0.95, "seed": 11},
    "beam": {"prompt": "ROMEO:\nWhat", "max_new_tokens": 24, "num_beams": 3},
}
TRANSLATION_TARGETS = {
    "greedy": {"text": "Ein Mann fährt Fahrrad.", "num_beams": 1, "max_new_tokens": 30},
    "beam": {"text": "Ein Mann fährt Fahrrad.", "num_beams": 4, "max_new_tokens": 30},
}



@pytest.fixture(scope="module")
def variant_repository(tiny_repository_copy, data_dir) -> tuple[Path, list[tuple[str, int]]]:
    """The tiny gpt and translation (version 1) and their in-place variants as versions 2, 3, ..."""
    repository = tiny_repository_copy("variants", ("gpt", "translation"))
    made, next_version = [], {"gpt": 2, "translation": 2}
    for name, arguments in VARIANTS:
        version = next_version[name]
        assert convert_main(["--repository", str(repository), "--name", name, "--from-version", "1",
                             "--to-version", str(version), "--data-dir", str(data_dir), *arguments]) == 0
        made.append((name, version))
        next_version[name] += 1
    return repository, made


@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
def test_tiny_in_place_variants_decode_the_samealone_and_among_others(variant_repository, serving, mode):
    repository, made = variant_repository
    settings = Settings(repository=repository, models=[f"{name}:{version}" for name, version in made],
                        max_new_tokens=64)
    with serving(settings) as client:
        for name, version in made:
            targets = GPT_TARGETS if name == "gpt" else TRANSLATION_TARGETS
            if mode not in targets:
                continue
            alone, together = alone_and_among_others(client, name, {**targets[mode], "version": version})
            assert together == [alone] * len(together), (name, version, mode)


COMPLETIONS = {  # OpenAI completions on the released GPT: every token's log-probability compared exactly
    "greedy": {"model": "gpt", "prompt": "ROMEO:\nWhat", "max_tokens": 40, "temperature": 0, "logprobs": 2},
    "sample": {"model": "gpt", "prompt": "ROMEO:\nWhat", "max_tokens": 40, "temperature": 1.0, "seed": 11,
               "logprobs": 2},
}


@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
def test_the_released_gpt_decodes_the_samealone_and_among_others(serving, mode):
    settings = Settings(repository=RELEASE_REPOSITORY, models=["gpt"], max_new_tokens=64)
    with serving(settings) as client:
        version = ModelRepository(RELEASE_REPOSITORY).get("gpt").version  # the served one, named explicitly
        alone, together = alone_and_among_others(client, "gpt", {**GPT_TARGETS[mode], "version": version})
        assert together == [alone] * len(together), mode
        if mode in COMPLETIONS:
            alone, together = alone_and_among_others(client, "gpt", COMPLETIONS[mode])
            assert together == [alone] * len(together), mode


JOIN_STEP, SWAP_STEP, DROP_STEP = 2, 4, 6  # when the batch of `_logits_alone_and_batched` changes
FILLER = -1  # the batch row that is no input's: the longest input once more, dropped at DROP_STEP


def _logits_alone_and_batched(engine, inputs: list[list[int]], steps: int) -> tuple[list, list]:
    """Each input's logits over `steps` greedy steps decoded alone, and decoded in a batch that starts with the
    first half of them and a filler row (the longest input again), is joined by the rest at JOIN_STEP, swaps its
    first two rows at SWAP_STEP (beams taking each other's place) and drops the filler at DROP_STEP: a row's logits
    must depend on none of that. `engine`: a GPT or translation engine (prompts or sources: `prefill`, `step`,
    `select`, `concatenate` alike)."""
    def greedy_alone(ids):
        logits, state = engine.prefill([ids])
        out = []
        for _ in range(steps):
            out.append(logits[0])
            logits = engine.step(state, logits.argmax(-1))
        return np.stack(out)

    alone = [greedy_alone(ids) for ids in inputs]
    half = len(inputs) // 2
    rows = [FILLER, *range(half)]  # the input each row of the batch decodes
    logits, state = engine.prefill([max(inputs, key=len), *inputs[:half]])
    seen: dict[int, list] = {i: [] for i in range(len(inputs))}
    for step in range(steps + JOIN_STEP + 1):
        order = None
        if step == JOIN_STEP:
            joining, other = engine.prefill(inputs[half:])
            state = engine.concatenate([state, other])
            logits = np.concatenate([logits, joining])
            rows += list(range(half, len(inputs)))
        elif step == SWAP_STEP:
            order = np.array([1, 0, *range(2, len(rows))])
        elif step == DROP_STEP:
            order = np.array([row for row, i in enumerate(rows) if i != FILLER])
        if order is not None:
            state = engine.select(state, order)
            logits, rows = logits[order], [rows[row] for row in order]
        for row, i in enumerate(rows):
            if i != FILLER:
                seen[i].append(logits[row])
        logits = engine.step(state, logits.argmax(-1))
    return alone, [np.stack(seen[i][:steps]) for i in range(len(inputs))]


@pytest.mark.parametrize("variant", [None, "int8rows"])
def test_the_released_translators_in_place_option_is_bit_identical_alone_and_in_a_batch_that_others_join(tmp_path,
                                                                                                          variant):
    """The option the README states the cost of: the released translator's weights with the in-place step graph (what
    `python -m export.convert --kv-cache inplace` writes, without its quality check), as stored and on the integer
    GEMM (`int8rows`)."""
    from export.kv_inplace import add_step_graph
    from service.engines.runtime import RuntimeOptions
    from service.engines.translation import TranslationEngine

    released = ModelRepository(RELEASE_REPOSITORY).get("translation")
    version = tmp_path / "translation" / str(released.version)
    shutil.copytree(released.path, version)
    config = json.loads((version / "config.json").read_text())
    add_step_graph(version, config)
    (version / "config.json").write_text(json.dumps(config))
    engine = TranslationEngine(ModelRepository(tmp_path).get("translation", released.version),
                               RuntimeOptions(weights=variant))
    sources = [engine.source_ids(text) for text in [TRANSLATION_TARGETS["greedy"]["text"], *GERMAN, "Hallo."]]
    alone, batched = _logits_alone_and_batched(engine, sources, steps=12)
    for source, (a, b) in enumerate(zip(alone, batched)):
        np.testing.assert_array_equal(a, b, err_msg=f"source {source}")


@pytest.mark.parametrize("variant", [None, "int8+gqa", "fp32+gqa", "int8rows", "int8rows+gqa"])
@pytest.mark.parametrize("version", ["tiny-int8-mha-inplace", "release-served"])
def test_a_rows_logits_are_bit_identical_alone_and_in_a_batch_that_others_join(variant_repository, version, variant):
    """As stored, and in the variants whose step attention is GroupQueryAttention over each row's own slots
    (`service.engines.step_attention`)."""
    from service.engines.gpt import GPTEngine
    from service.engines.runtime import RuntimeOptions

    repository, made = variant_repository
    model = ModelRepository(RELEASE_REPOSITORY).get("gpt") if version == "release-served" else \
        ModelRepository(repository).get("gpt", made[0][1])
    engine = GPTEngine(model, RuntimeOptions(weights=variant))
    prompts = [engine.tokenizer.encode(text).ids[: engine.context_length // 2] for text in GPT_PROMPTS]
    alone, batched = _logits_alone_and_batched(engine, prompts, steps=12)
    for prompt, (a, b) in enumerate(zip(alone, batched)):
        np.testing.assert_array_equal(a, b, err_msg=f"prompt {prompt}: {GPT_PROMPTS[prompt]!r}")


SHARED_PREFIX = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"


def test_the_released_gpt_decodes_the_same_with_its_prefix_cache_on_and_off_hit_or_miss(serving):
    """The golden outputs with cached prefixes: a cache-off server's alone, against a cache-on server's first
    request (a miss), its repeat (a hit) and among others that share the prefix."""
    targets = {mode: {**body, "prompt": SHARED_PREFIX + body["prompt"]} for mode, body in GPT_TARGETS.items()}
    targets.update({f"completions {mode}": {**body, "prompt": SHARED_PREFIX + body["prompt"]}
                    for mode, body in COMPLETIONS.items()})
    with serving(Settings(repository=RELEASE_REPOSITORY, models=["gpt"], max_new_tokens=64,
                          prefix_cache=False)) as client:
        reference = {mode: alone_and_among_others(client, "gpt", target)[0] for mode, target in targets.items()}
    with serving(Settings(repository=RELEASE_REPOSITORY, models=["gpt"], max_new_tokens=64)) as client:
        for mode, target in targets.items():
            miss, together = alone_and_among_others(client, "gpt", target)
            hit, _ = alone_and_among_others(client, "gpt", target)
            assert [miss, hit, *together] == [reference[mode]] * (2 + len(together)), mode


@pytest.mark.parametrize("variant", [None, "fp32+gqa+kv8", "int8rows+gqa+kv8"])
def test_a_rows_logits_are_bit_identical_from_cached_prefixes_alone_and_in_a_batch_that_others_join(variant):
    """`_logits_alone_and_batched` on an engine with a prefix cache (the alone runs fill it, the batch's prefills
    hit it), against the same engine without one."""
    from service.engines.gpt import GPTEngine
    from service.engines.runtime import RuntimeOptions

    model = ModelRepository(RELEASE_REPOSITORY).get("gpt")
    cached = GPTEngine(model, RuntimeOptions(weights=variant, prefix_cache_bytes=64 << 20))
    plain = GPTEngine(model, RuntimeOptions(weights=variant))
    prompts = [cached.tokenizer.encode(SHARED_PREFIX + text).ids[: cached.context_length // 2]
               for text in GPT_PROMPTS]
    reference, _ = _logits_alone_and_batched(plain, prompts, steps=12)
    alone, batched = _logits_alone_and_batched(cached, prompts, steps=12)
    assert cached.prefix_cache.stats.hit_tokens > 0
    for prompt, (r, a, b) in enumerate(zip(reference, alone, batched)):
        np.testing.assert_array_equal(r, a, err_msg=f"prompt {prompt} alone")
        np.testing.assert_array_equal(r, b, err_msg=f"prompt {prompt} batched")
