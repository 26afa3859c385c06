"""Inference in the Open Inference Protocol, whatever carries it (REST: `service.api.oip.router`; gRPC:
`service.api.oip.grpc`): a parsed request (`InferenceRequest` and its input tensors, `service.api.oip.protocol`) ->
checks against the model's signature -> the serving layer -> output tensors, the ones asked for. Each transport
parses its own body and encodes its own response; the tensor mapping, limits, options and deadlines are here once.

Each model's tensors are its signature's (`service.api.oip.signatures`, also in its metadata); decoding options are
request `parameters`, as the native API names them. The deadline is the `timeout` parameter (microseconds), else
the transport's own, else the server's default; never past TSERVE_MAX_TIMEOUT_MS. Streaming (`stream`, gRPC's
ModelStreamInfer): a request with one text and a search of one row yields its text as it becomes final.

Invariant: each input must have its signature's datatype, and a parameter that names what the request gives
otherwise (the input tensors, the model and version, the deadline) is refused, so the tensors' limits always hold.

Design notes (each model's tensors, streaming): docs/architecture.md, service/api/oip/inference.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np

from service.api.constraint_fields import json_text
from service.api.oip.protocol import (PRIORITY, RESERVED_PARAMETERS, InferenceRequest, classification,
                                      triton_priority, validated_options)
from service.api.oip.signatures import signature
from service.engines.imaging import EncodedImage
from service.errors import BadInput
from service.models.registry import LoadedModel
from service.repository import GPT, TRANSLATION, VIT
from service.serving import classify as classification_service
from service.serving import generate as generation
from service.serving import translate as translation
from service.serving.constrain import compile_constraint
from service.serving.context import Caller, deadline_of, label
from service.serving.streaming import Piece

# Native request fields that an inference request gives in another way, and where: as `parameters` they are refused
# (400), so that they can neither replace the input tensors (and slip past their limits) nor be silently ignored.
GIVEN_OTHERWISE = {"text": "the texts are the TEXT input", "prompt": "the prompts are the PROMPT input",
                   "images": "the images are the IMAGE or PIXELS input", "model": "the model is the request's",
                   "version": "the version is the request's",
                   "timeout_ms": "the deadline is the `timeout` parameter, in microseconds",
                   "stream": "a request streams over gRPC's ModelStreamInfer, not by a parameter"}
# A PIXELS value is a pixel already scaled to [0, 1]; beyond that range the model's arithmetic can overflow.
PIXEL_RANGE = (0.0, 1.0)
MICROSECONDS_PER_MS = 1000  # the `timeout` parameter is in microseconds, the serving deadline in ms
JSON_PARAMETERS = ("json_schema", "choice")  # gpt parameters given as JSON text (a string), or over REST as JSON
Tensor = tuple[str, str, np.ndarray]  # name, datatype, array
Tensors = dict[str, np.ndarray]


def options_of(inference: InferenceRequest) -> dict:
    """The request's model options: its parameters less the protocol's own, and the queue level its Triton
    `priority` asks for as the native option `priority`; 400 for one given otherwise."""
    options = {k: v for k, v in inference.parameters.items() if k not in RESERVED_PARAMETERS}
    if given := sorted(set(options) & set(GIVEN_OTHERWISE)):
        raise BadInput("; ".join(f"parameter {key!r} is not an option here: {GIVEN_OTHERWISE[key]}" for key in given))
    level = triton_priority(inference)
    return options if level is None else {**options, PRIORITY: level}


def deadline(request: Caller, inference: InferenceRequest, transport_ms: int | None = None) -> float:
    """The request's deadline (time.monotonic() seconds): its `timeout` parameter (400 past TSERVE_MAX_TIMEOUT_MS),
    else `transport_ms` (a gRPC call's remaining time, held to TSERVE_MAX_TIMEOUT_MS), else the server's default."""
    settings = request.app.state.settings
    timeout_us = inference.parameters.get("timeout")  # an integer >= 1 (the parser checked)
    if timeout_us is not None:
        timeout_ms = max(1, timeout_us // MICROSECONDS_PER_MS)
        if timeout_ms > settings.max_timeout_ms:
            raise BadInput(f"parameters.timeout exceeds TSERVE_MAX_TIMEOUT_MS ({settings.max_timeout_ms} ms)")
    else:
        timeout_ms = None if transport_ms is None else max(1, min(transport_ms, settings.max_timeout_ms))
    return deadline_of(request, timeout_ms)


def check_inputs(loaded: LoadedModel, inference: InferenceRequest, tensors: Tensors) -> None:
    """400 unless every input is one of the model's, of its signature's datatype."""
    datatypes = signature(loaded).input_datatypes()
    if unknown := sorted(set(tensors) - set(datatypes)):
        raise BadInput(f"unknown input(s) {unknown} for model {loaded.name!r} (inputs: {sorted(datatypes)})")
    for tensor in inference.inputs:
        if tensor.datatype != datatypes[tensor.name]:
            raise BadInput(f"input {tensor.name!r} must be {datatypes[tensor.name]}, got {tensor.datatype}")


async def infer(request: Caller, loaded: LoadedModel, inference: InferenceRequest, tensors: Tensors,
                in_json: set[str], transport_ms: int | None = None) -> list[Tensor]:
    """The output tensors of an inference request, those it asked for (all when it names none)."""
    options = options_of(inference)
    until = deadline(request, inference, transport_ms)
    check_inputs(loaded, inference, tensors)
    outputs = await ADAPTERS[loaded.kind](request, loaded, tensors, in_json, options, until)
    return _select(loaded, inference, outputs)


def _select(loaded: LoadedModel, inference, outputs: list[Tensor], partial: bool = False) -> list[Tensor]:
    """The outputs the request asked for (all when it names none), with the classification extension applied;
    `partial`: a stream's chunk, which holds some of the outputs only (the others come with the last chunk)."""
    if not inference.outputs:
        return outputs
    by_name = {name: (name, datatype, array) for name, datatype, array in outputs}
    selected = []
    for wanted in inference.outputs:
        if partial and wanted.name not in by_name and wanted.name in signature(loaded).output_names():
            continue
        if wanted.name not in by_name:
            raise BadInput(f"unknown output {wanted.name!r} for model {loaded.name!r} (outputs: {sorted(by_name)})")
        name, datatype, array = by_name[wanted.name]
        k = wanted.parameters.get("classification")  # an integer >= 1 (parse_request checked)
        if k is not None:
            if name != "PROBABILITIES":
                raise BadInput(f"classification: a count on PROBABILITIES only, not on {name!r}")
            name, datatype, array = name, "BYTES", classification(array, loaded.engine.labels, k)
        selected.append((name, datatype, array))
    return selected


# --- per model ---------------------------------------------------------------------------------------------------


def _only(tensors: dict[str, np.ndarray], names: tuple[str, ...]) -> tuple[str, np.ndarray]:
    given = [n for n in names if n in tensors]
    if len(given) != 1:
        raise BadInput(f"give exactly one input of {list(names)}")
    return given[0], tensors[given[0]]


def _texts(name: str, array: np.ndarray) -> list[str]:
    try:
        return [x.decode("utf-8") for x in array.reshape(-1)]
    except UnicodeDecodeError:
        raise BadInput(f"input {name!r}: an element is not UTF-8 text") from None


async def _vit(request: Caller, loaded: LoadedModel, tensors, in_json: set[str], options: dict,
               deadline: float) -> list[Tensor]:
    options = dict(options)
    priority = options.pop(PRIORITY, None)
    if options:
        raise BadInput(f"unknown parameter(s) {sorted(options)} for an image model")
    engine, settings = loaded.engine, request.app.state.settings
    name, array = _only(tensors, ("IMAGE", "PIXELS"))
    label(request, loaded, "classify")
    count = len(array) if array.ndim else 0
    if not 1 <= count <= settings.max_images:
        raise BadInput(f"input {name!r}: 1 to {settings.max_images} images (TSERVE_MAX_IMAGES), got {count}")
    if name == "IMAGE":
        if array.ndim != 1:
            raise BadInput(f"input 'IMAGE' has shape {list(array.shape)}; expected [N]")
        images = [EncodedImage(f"IMAGE[{i}]", x.decode("ascii", "replace") if name in in_json else x)
                  for i, x in enumerate(array)]
        probabilities = await classification_service.classify(request, loaded, images, deadline, priority)
    else:
        size, channels = engine.size, engine.channels
        shapes = [(count, channels, size, size)] + ([(count, size, size)] if channels == 1 else [])
        if array.shape not in shapes:
            raise BadInput(f"input 'PIXELS' has shape {list(array.shape)}; expected {[list(s) for s in shapes]}")
        low, high = PIXEL_RANGE
        if not ((array >= low) & (array <= high)).all():  # a NaN fails both comparisons
            raise BadInput(f"input 'PIXELS' holds a value outside [{low:g}, {high:g}] (or a NaN): pixels must be "
                           "scaled to [0, 1]")
        pixels = engine.normalize(array.reshape(count, channels, size, size))
        probabilities = await classification_service.classify_pixels(request, loaded, pixels, deadline, priority)
    labels = np.array([engine.labels[i].encode() for i in probabilities.argmax(axis=1)], dtype=object)
    return [("PROBABILITIES", "FP32", probabilities), ("LABEL", "BYTES", labels)]


async def _translation(request: Caller, loaded: LoadedModel, tensors, in_json: set[str], options: dict,
                       deadline: float) -> list[Tensor]:
    name, array = _only(tensors, ("TEXT",))
    texts = _texts(name, array)
    if options.get("num_return_sequences", 1) != 1:
        raise BadInput("num_return_sequences is not available here: one translation per text")
    body = validated_options(request.app.state.request_models.translate, {**options, "text": texts}, "parameters")
    params = body.to_params()
    label(request, loaded, params.mode)
    results = await translation.translate(request, loaded, texts, params, deadline)
    best = [completions[0] for completions in results]
    return [("TRANSLATION", "BYTES", np.array([c.text.encode() for c in best], dtype=object).reshape(array.shape)),
            ("SCORE", "FP32", np.array([c.score for c in best], dtype=np.float32).reshape(array.shape))]


def _gpt_params(request: Caller, options: dict, prompts: list[str]):
    """The generation parameters of `options`, checked with each prompt by the native request model."""
    if not prompts or len(prompts) > request.app.state.settings.max_texts:
        raise BadInput(f"input 'PROMPT': 1 to {request.app.state.settings.max_texts} prompts (TSERVE_MAX_TEXTS)")
    if isinstance(options.get("stop"), str):
        options = {**options, "stop": [options["stop"]]}
    # a parameter is a string, a number or a boolean (gRPC's InferParameter): a schema and a choice list as JSON text
    options = {**options, **{name: json_text(options[name], f"parameters.{name}") for name in JSON_PARAMETERS
                             if name in options}}
    bodies = [validated_options(request.app.state.request_models.generate, {**options, "prompt": p}, f"PROMPT[{i}]")
              for i, p in enumerate(prompts)]
    return bodies[0].to_params(fields="parameters.")


async def _gpt(request: Caller, loaded: LoadedModel, tensors, in_json: set[str], options: dict,
               deadline: float) -> list[Tensor]:
    name, array = _only(tensors, ("PROMPT",))
    prompts = _texts(name, array)
    params = _gpt_params(request, options, prompts)
    label(request, loaded, params.mode)
    ids = await generation.encode_prompts(loaded, prompts, params.max_new_tokens, "parameters.max_new_tokens")
    results = await generation.generate(request, loaded, ids, params, deadline)
    best = [completions[0] for completions in results]
    return [("TEXT", "BYTES", np.array([c.text.encode() for c in best], dtype=object).reshape(array.shape)),
            ("FINISH_REASON", "BYTES",
             np.array([c.finish_reason.encode() for c in best], dtype=object).reshape(array.shape))]


ADAPTERS: dict[str, Callable[..., Awaitable[list[Tensor]]]] = {VIT: _vit, TRANSLATION: _translation, GPT: _gpt}


# --- streaming ---------------------------------------------------------------------------------------------------

# per streamable kind: the input, the output its text chunks go to, and the final output beside it
STREAMED = {GPT: ("PROMPT", "TEXT", "FINISH_REASON"), TRANSLATION: ("TEXT", "TRANSLATION", "SCORE")}


def streams(request: Caller, loaded: LoadedModel, inference: InferenceRequest, tensors: Tensors) -> bool:
    """Whether `stream` can stream this request: a text model, one text, a search of one row (no beams: neither
    the request's `num_beams` nor, when it gives none, its model's default, the translation's beam search)."""
    if loaded.kind not in STREAMED:
        return False
    array = tensors.get(STREAMED[loaded.kind][0])
    models = request.app.state.request_models
    options = models.generate if loaded.kind == GPT else models.translate  # the native model that checks them
    beams = inference.parameters.get("num_beams", options.model_fields["num_beams"].default)
    return array is not None and array.size == 1 and beams == 1 and \
        inference.parameters.get("num_return_sequences", 1) == 1 and inference.parameters.get("n", 1) == 1


async def stream(request: Caller, loaded: LoadedModel, inference: InferenceRequest, tensors: Tensors,
                 transport_ms: int | None = None) -> AsyncIterator[tuple[list[Tensor], bool]]:
    """(outputs, final) per decoding wake-up of a request `streams` accepts: the text chunk (BYTES [1]) and, with
    the last, the finish reason (gpt) or the score (translation). A decoding error is raised, as `infer` raises it;
    leaving the iteration early cancels the request's job (its rows are freed at the next step)."""
    options = options_of(inference)
    until = deadline(request, inference, transport_ms)
    check_inputs(loaded, inference, tensors)
    source, text_output, final_output = STREAMED[loaded.kind]
    name, array = _only(tensors, (source,))
    (text,) = _texts(name, array)
    if loaded.kind == GPT:
        params = _gpt_params(request, options, [text])
        label(request, loaded, params.mode)
        (ids,) = await generation.encode_prompts(loaded, [text], params.max_new_tokens, "parameters.max_new_tokens")
        params = await compile_constraint(loaded, params)  # before the stream: a bad constraint is a 400
        events = await generation.stream(loaded, [ids], params, until)

        def final(completion) -> Tensor:
            return final_output, "BYTES", np.array([completion.finish_reason.encode()], dtype=object)
    else:
        params = validated_options(request.app.state.request_models.translate, {**options, "text": text},
                                   "parameters").to_params()
        label(request, loaded, params.mode)
        events = await translation.stream(loaded, text, params, until)

        def final(completion) -> Tensor:
            return final_output, "FP32", np.array([completion.score], dtype=np.float32)

    def chunk(text: str) -> Tensor:
        return text_output, "BYTES", np.array([text.encode()], dtype=object)

    try:
        async for batch in events:
            pieces = "".join(event.text for event in batch if isinstance(event, Piece))
            done = [event for event in batch if not isinstance(event, Piece)]
            if not done:
                if pieces and (outputs := _select(loaded, inference, [chunk(pieces)], partial=True)):
                    yield outputs, False
                continue
            (finished,) = done
            if finished.error is not None:
                raise finished.error
            yield _select(loaded, inference, [chunk(pieces + finished.rest), final(finished.completion)]), True
            return
    finally:
        await events.aclose()
