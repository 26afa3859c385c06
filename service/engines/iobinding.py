"""The in-place decoder step: a buffered `KVCache` bound to the step graph through ONNX Runtime IO bindings.

An in-place step graph (`export.kv_inplace`) takes the cache buffers as its past and writes each row's new
keys/values into slot `cache_slot[row]` of the same buffers, its present: binding both to one array by address
(ONNX Runtime's IO binding, as onnxruntime-genai binds its KV buffers) lets a step write its slot without copying
the past. `InPlaceStep` keeps one binding per session (the wide one and the one-thread one, `OneThreadSession`) for
as long as the arrays they point into live (`KVCache.step_binding`), so a step costs no binding calls and no
allocation until the buffers are replaced (growth, compaction, a join).
The buffers themselves, their layout and their growth are `service.engines.kv_cache`'s.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.engines import onnx_schema as schema
from service.engines.kv_cache import KVCache
from service.engines.onnx_schema import past_names, present_names
from service.decoding.types import StepLogits
from service.engines.runtime import EngineCalls, OneThreadSession, RuntimeOptions, create_session

DEVICE, DEVICE_ID = "cpu", 0  # where the bound arrays live: numpy memory, ONNX Runtime's CPU device 0


def bind_array(binding, name: str, array: np.ndarray | ort.OrtValue, output: bool = False) -> np.ndarray | ort.OrtValue:
    """Bind a C-contiguous CPU array to an ONNX Runtime IO binding by address (no copy), or an OrtValue where it
    lives (a device cache's tensors, `service.engines.device_cache`); returns what was bound, which the caller
    keeps alive until the run is over."""
    if isinstance(array, ort.OrtValue):
        (binding.bind_ortvalue_output if output else binding.bind_ortvalue_input)(name, array)
        return array
    array = np.ascontiguousarray(array)
    bind = binding.bind_output if output else binding.bind_input
    bind(name, DEVICE, DEVICE_ID, array.dtype, array.shape, array.ctypes.data)
    return array


def shape_of(array: np.ndarray | ort.OrtValue) -> tuple[int, ...]:
    return tuple(array.shape()) if isinstance(array, ort.OrtValue) else array.shape


def host_bytes(arrays) -> int:
    """The bytes of the host arrays among `arrays` (what ONNX Runtime copies to or from a GPU's memory when a run
    binds them; OrtValues, already where the graph runs, count nothing)."""
    return sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))


@dataclass
class HostTransfers:
    """What an engine's decoder calls bound in host memory, by steps: the KV cache's keys and values (none when the
    cache lives on the device, `service.engines.device_cache`; the whole cache every step when a CUDA run binds a
    numpy cache) and the rest (token ids, positions, mask, slots, logits, candidates)."""

    steps: int = 0
    kv_bytes: int = 0
    other_bytes: int = 0

    def add(self, kv: int, other: int) -> None:
        self.steps += 1
        self.kv_bytes += kv
        self.other_bytes += other


def run_bound(session, host: dict[str, np.ndarray], device: dict[str, ort.OrtValue], host_outputs: list[str],
              device_outputs: list[str], placement, transfers: HostTransfers | None = None, kv: tuple = ()
              ) -> tuple[list[np.ndarray], list[ort.OrtValue]]:
    """One run of `session` with `host` arrays and `device` OrtValues as inputs -> (the `host_outputs`, as numpy
    arrays; the `device_outputs`, as OrtValues left on `placement`'s device). `transfers`: counted there, the host
    inputs named in `kv` as the KV cache's."""
    binding = session.io_binding()
    for name, value in device.items():
        binding.bind_ortvalue_input(name, value)
    held = [bind_array(binding, name, array) for name, array in host.items()]  # alive until the run is over
    for name in host_outputs:
        binding.bind_output(name, DEVICE, DEVICE_ID)
    for name in device_outputs:
        binding.bind_output(name, placement.device, placement.device_id)
    session.run_with_iobinding(binding)
    del held
    outputs = binding.get_outputs()
    results = [value.numpy() for value in outputs[: len(host_outputs)]]
    if transfers is not None:
        kv_bytes = host_bytes(array for name, array in host.items() if name in kv)
        transfers.add(kv_bytes, host_bytes(host.values()) - kv_bytes + host_bytes(results))
    return results, outputs[len(host_outputs) :]


def bind_cache(binding, cache: KVCache) -> list[np.ndarray]:
    """Bind each layer's past and present to the same buffer of a buffered `cache`, so that the in-place graph
    writes the new slot without copying the past; returns what the binding points into."""
    bound = []
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        for name, present, array in zip(past_names(i), present_names(i), (k, v)):
            bound.append(bind_array(binding, name, array))
            bind_array(binding, present, array, output=True)
    return bound


@dataclass
class StepBinding:
    """The arrays an in-place step graph's IO bindings point into, and a binding per session over them
    (`InPlaceStep`); `key` says which cache buffers and inputs they were made for."""

    key: tuple
    bindings: dict[int, object]  # id(session) -> its IO binding over these arrays
    ids: np.ndarray  # (R, 1) int64, written each step
    slot: np.ndarray  # (R,) int64: each row's slot, written each step
    logits: np.ndarray  # (R, 1, V) float32, the graph's output
    held: list[np.ndarray]  # kept alive as long as the binding
    candidates: np.ndarray | None = None  # (1,) int64, written each step: the k of a graph with row candidates
    top_logprobs: np.ndarray | None = None  # (R, 1, k) float32, its output
    top_ids: np.ndarray | None = None  # (R, 1, k) int64
    kv_bytes: int = 0  # host bytes a step binds (`HostTransfers`): the cache's keys and values
    other_bytes: int = 0  # and the rest


class InPlaceStep:
    """Runs an in-place step graph (`export.kv_inplace`) over a buffered `KVCache`, through an ONNX Runtime IO
    binding per session (the step graph's, and its one-thread session's) that lasts as long as the arrays it points
    into: a step writes the token ids and the slot into arrays the bindings already hold and runs, so it costs no
    binding calls and no allocation unless the cache's buffers were replaced (growth, compaction, a join) or the
    other inputs changed. The bindings live on the cache, so one engine may step several caches (from several
    threads)."""

    def __init__(self, session, vocab_size: int, one_thread: OneThreadSession | None = None,
                 transfers: HostTransfers | None = None):
        slot = next((i for i in session.get_inputs() if i.name == schema.CACHE_SLOT), None)
        if slot is None or len(slot.shape) != 1:
            raise ValueError(f"the step graph's {schema.CACHE_SLOT} input must be one slot per row (rows,), got "
                             f"{None if slot is None else slot.shape}: a graph exported before each row wrote its own "
                             f"slot; derive it again with `python -m export.convert ... --kv-cache inplace`")
        self.session = session
        self.vocab_size = vocab_size
        self.one_thread = one_thread  # small steps' session, if any (`service.engines.runtime.OneThreadSession`)
        # a graph with row candidates (`service.engines.row_candidates`) returns a `StepLogits`
        self.row_candidates = any(o.name == schema.TOP_IDS for o in session.get_outputs())
        self.transfers = transfers  # the engine's count of what each step binds in host memory, if it keeps one

    def run(self, cache: KVCache, tokens: np.ndarray, inputs: dict[str, np.ndarray] | None = None,
            candidates: int = 0) -> np.ndarray | StepLogits:
        """Feed one token per row (R,) and return the next-token logits (R, V), or on a graph with row candidates
        a `StepLogits` with each row's ``candidates`` most likely tokens (at least one); `inputs`: the graph's
        other inputs (e.g. the encoder's), bound by address as they are."""
        inputs = inputs or {}
        k = max(1, candidates) if self.row_candidates else 0
        slots = cache.open_slot()
        arrays = (*cache.keys, *cache.values, cache.mask, cache.positions, *inputs.values())
        # which arrays, by identity (cheaper than reading each one's address): the bindings hold them (`_bind`)
        key = (cache.rows, cache.capacity, k, *map(id, arrays), *map(shape_of, inputs.values()))
        bound = cache.step_binding
        if bound is None or bound.key != key:
            bound = cache.step_binding = self._bind(key, cache, inputs, arrays, k)
        bound.ids[:, 0] = tokens
        bound.slot[:] = slots
        with self._session(cache.rows) as session:
            binding = bound.bindings.get(id(session))
            if binding is None:
                binding = bound.bindings[id(session)] = self._session_binding(session, bound, cache, inputs)
            session.run_with_iobinding(binding)
        if self.transfers is not None:
            self.transfers.add(bound.kv_bytes, bound.other_bytes)
        cache.advance()
        logits = bound.logits[:, -1].copy()
        if not k:
            return logits
        return StepLogits(logits, bound.top_logprobs[:, -1].copy(), bound.top_ids[:, -1].copy())

    def _session(self, rows: int):
        """A context giving the session a step of ``rows`` rows runs on (`OneThreadSession.call`)."""
        if self.one_thread is None:
            return nullcontext(self.session)
        return self.one_thread.call(rows, self.session)

    def _bind(self, key: tuple, cache: KVCache, inputs: dict[str, np.ndarray], keyed: tuple[np.ndarray, ...],
              k: int) -> StepBinding:
        """The arrays the sessions' bindings for `key` point into (bound per session by `_session_binding`); it holds
        the `keyed` arrays themselves too (a copy, for an input that was not contiguous), so that no id in `key` can
        be reused while it lives."""
        R, V = cache.rows, self.vocab_size
        bound = StepBinding(key, {}, np.zeros((R, 1), np.int64), np.zeros(R, np.int64),
                            np.empty((R, 1, V), np.float32), list(keyed))  # logits (R, 1, V): one new token a row
        if k:
            bound.candidates = np.array([k], np.int64)
            bound.top_logprobs = np.empty((R, 1, k), np.float32)
            bound.top_ids = np.empty((R, 1, k), np.int64)
        bound.kv_bytes = host_bytes((*cache.keys, *cache.values))
        bound.other_bytes = host_bytes((bound.ids, bound.slot, bound.logits, cache.mask, cache.positions,
                                        *inputs.values(), *(() if not k else (bound.candidates, bound.top_logprobs,
                                                                             bound.top_ids))))
        return bound

    @staticmethod
    def _session_binding(session, bound: StepBinding, cache: KVCache, inputs: dict[str, np.ndarray]):
        """`session`'s IO binding over `bound`'s arrays and the cache's buffers."""
        binding = session.io_binding()
        bound.held += [bind_array(binding, schema.INPUT_IDS, bound.ids),
                       bind_array(binding, schema.POSITION_IDS, cache.positions.reshape(-1, 1)),
                       bind_array(binding, schema.ATTENTION_MASK, cache.mask),
                       bind_array(binding, schema.CACHE_SLOT, bound.slot),
                       bind_array(binding, schema.LOGITS, bound.logits, output=True), *bind_cache(binding, cache)]
        bound.held += [bind_array(binding, name, array) for name, array in inputs.items()]
        if bound.candidates is not None:
            bound.held += [bind_array(binding, schema.CANDIDATES_K, bound.candidates),
                           bind_array(binding, schema.TOP_LOGPROBS, bound.top_logprobs, output=True),
                           bind_array(binding, schema.TOP_IDS, bound.top_ids, output=True)]
        return binding


def step_runners(folder: Path, step_file: str | None, decoder_file: str | None, decoder,
                 vocab_size: int, options: RuntimeOptions, row_candidates: bool = False,
                 calls: EngineCalls | None = None, transfers: HostTransfers | None = None
                 ) -> tuple[InPlaceStep | None, OneThreadSession | None]:
    """How an engine runs its one-token steps: on the in-place step graph `step_file` when the version has one
    (an `InPlaceStep`, with its own one-thread session), else on the decoder graph's session ``decoder`` (and a
    `OneThreadSession` of `decoder_file` for small steps) -> (in-place step or None, one-thread session or None).
    ``row_candidates``: the step graph and the one-thread session with them (`service.engines.row_candidates`),
    as ``decoder`` was made; ``calls``: the engine's calls the one-thread sessions count (`EngineCalls`);
    ``transfers``: where the steps count what they bind in host memory (`HostTransfers`)."""
    if step_file:
        step = create_session(folder / step_file, options, row_candidates)
        one_thread = OneThreadSession(folder / step_file, options, step, row_candidates, calls)
        return InPlaceStep(step, vocab_size, one_thread, transfers), None
    return None, OneThreadSession(folder / decoder_file, options, decoder, row_candidates, calls)
