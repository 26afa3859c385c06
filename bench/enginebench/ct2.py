"""CTranslate2 (`pip install ctranslate2`), the C++ engine a user would otherwise pick to serve a translator, on
the SAME weights as ours: our `EncoderDecoderTransformer` converted into CTranslate2's `TransformerSpec`
(`translation_spec`), and a `GenerateFn` over `ctranslate2.Translator` (`run_ctranslate2_translation`), which runs
in processes of its own (`Worker`; bench/bench_http.py times the same worker on the served translator's weights), at
the faster of its thread settings for each batch size (`ThreadChoice`).

The conversion, layer by layer (models/transformer.py, models/layers.py -> ctranslate2/specs/transformer_spec.py):
the shared embedding (scaled by sqrt(d), as ours) is the encoder's and the decoder's embeddings and the decoder's
output projection (tied; zero bias); our own sinusoidal table is given as the position encodings (CTranslate2's
built-in one interleaves sin and cos otherwise); each attention's q, k and v projections are concatenated into
CTranslate2's fused linear (self-attention: [q; k; v]; cross-attention: q, then [k; v]); Pre-LN norms map to the
sub-layers' `layer_norm`s, the final norms to the encoder's and decoder's; LayerNorm epsilon 1e-5 (PyTorch's).
The vocabulary is the ids themselves written as tokens ("0", "1", ...), so CTranslate2 takes and returns the same
ids as our engine. `agreement` checks the result against ours on the same sources: the fraction of identical
best beams, printed by every bench run that has both.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

import numpy as np

from .ours import translation_config
from .workloads import GenerateFn, Runtime, TranslationSpec, seed_torch, source_rows, spec_dir

LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which our model uses
WORKER_STOP_TIMEOUT_S = 10.0  # how long the worker has to return once told to, before it is killed


def _numpy(tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()


def _linear(spec, *layers) -> None:
    """CTranslate2's linear (a fused one when several layers are given: their outputs concatenated)."""
    spec.weight = np.concatenate([_numpy(layer.weight) for layer in layers], axis=0)
    spec.bias = np.concatenate([_numpy(layer.bias) for layer in layers], axis=0)


def _norm(spec, norm) -> None:
    spec.gamma, spec.beta = _numpy(norm.weight), _numpy(norm.bias)


def _ffn(spec, norm, ff) -> None:
    _norm(spec.layer_norm, norm)
    _linear(spec.linear_0, ff.up)
    _linear(spec.linear_1, ff.down)


def translation_spec(model):
    """Our translator as a CTranslate2 `TransformerSpec` (see the module's docstring)."""
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    if config.activation != "relu":
        raise NotImplementedError(f"activation {config.activation!r}: the converter maps relu")
    spec = transformer_spec.TransformerSpec.from_config(
        (config.n_encoder_layers, config.n_decoder_layers), config.n_heads, pre_norm=True,
        activation=common_spec.Activation.RELU)
    spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
    embedding = _numpy(model.embedding.weight)
    table = _numpy(model.positions.table)
    encoder, decoder = spec.encoder, spec.decoder
    encoder.embeddings[0].weight = embedding
    decoder.embeddings.weight = embedding
    encoder.scale_embeddings = decoder.scale_embeddings = True
    encoder.position_encodings.encodings = table
    decoder.position_encodings.encodings = table
    for ours, theirs in zip(model.encoder_layers, encoder.layer):
        attention = theirs.self_attention
        _norm(attention.layer_norm, ours.norm1)
        _linear(attention.linear[0], ours.attn.q_proj, ours.attn.k_proj, ours.attn.v_proj)
        _linear(attention.linear[1], ours.attn.out_proj)
        _ffn(theirs.ffn, ours.norm2, ours.ff)
    _norm(encoder.layer_norm, model.encoder_norm)
    for ours, theirs in zip(model.decoder_layers, decoder.layer):
        self_attention, cross = theirs.self_attention, theirs.attention
        _norm(self_attention.layer_norm, ours.norm1)
        _linear(self_attention.linear[0], ours.self_attn.q_proj, ours.self_attn.k_proj, ours.self_attn.v_proj)
        _linear(self_attention.linear[1], ours.self_attn.out_proj)
        _norm(cross.layer_norm, ours.norm2)
        _linear(cross.linear[0], ours.cross_attn.q_proj)
        _linear(cross.linear[1], ours.cross_attn.k_proj, ours.cross_attn.v_proj)
        _linear(cross.linear[2], ours.cross_attn.out_proj)
        _ffn(theirs.ffn, ours.norm3, ours.ff)
    _norm(decoder.layer_norm, model.decoder_norm)
    decoder.projection.weight = embedding
    decoder.projection.bias = np.zeros(len(embedding), np.float32)
    tokens = [str(i) for i in range(config.vocab_size)]
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    spec.config.bos_token, spec.config.eos_token = str(config.bos_id), str(config.eos_id)
    spec.config.unk_token = str(config.pad_id)  # every id is a token: nothing is ever unknown
    spec.config.decoder_start_token = str(config.bos_id)
    return spec


def convert(model, folder: Path, quantization: str | None = None) -> Path:
    """Write the CTranslate2 model of `model` into `folder` (once per folder) and return it."""
    if not (folder / "model.bin").exists():
        spec = translation_spec(model)
        spec.validate()
        spec.optimize(quantization=quantization)
        folder.mkdir(parents=True, exist_ok=True)
        spec.save(str(folder))
    return folder


def _serve(folder: str, compute_type: str, threads: int, connection) -> None:
    """The child process: a Translator on `folder`; each message (token lists, beams, tokens) -> the best beams
    (None, or the pipe closing, ends it)."""
    import ctranslate2

    translator = ctranslate2.Translator(folder, device="cpu", compute_type=compute_type, intra_threads=threads,
                                        inter_threads=1)
    connection.send("ready")
    while True:
        try:
            message = connection.recv()
        except EOFError:  # the benchmark ended (its end of the pipe closed)
            return
        if message is None:
            return
        tokens, beams, new_tokens = message
        results = translator.translate_batch(tokens, beam_size=beams, length_penalty=1.0,
                                             max_decoding_length=new_tokens, min_decoding_length=new_tokens,
                                             return_scores=False)
        connection.send([[int(t) for t in r.hypotheses[0]] for r in results])


class Worker:
    """A `ctranslate2.Translator` on the converted model in `folder`, in a process of its own (spawned: no torch in
    it) with `threads` intra-op threads and its library's own wait policy, sent the sources over a pipe (a fraction
    of a millisecond per sentence): in the benchmark's process, beside torch's OpenMP pool, and under its
    OMP_WAIT_POLICY=PASSIVE, its OpenMP threads ran 5x slower (measured on the release shape, 2 threads, beam 4:
    6.0 sentences/s under PASSIVE, 32.6 with its defaults, 7.1 in-process with --spin)."""

    name = "ctranslate2"

    def __init__(self, folder: Path, compute_type: str, threads: int):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        policy = os.environ.pop("OMP_WAIT_POLICY", None)  # the child starts with CTranslate2's own default
        try:
            self.process = context.Process(target=_serve, args=(str(folder), compute_type, threads, child),
                                           daemon=True)
            self.process.start()
        finally:
            if policy is not None:
                os.environ["OMP_WAIT_POLICY"] = policy
        if self._pipe.recv() != "ready":
            raise RuntimeError("the CTranslate2 worker did not start")

    @property
    def pid(self) -> int:
        return self.process.pid

    def send_signal(self, signum: int) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signum)

    def translate(self, sources: list[list[int]], num_beams: int, new_tokens: int) -> list[list[int]]:
        """The best beams of `sources` (token ids, each with its EOS, as ours reads it): beam search like ours,
        `num_beams`, length penalty 1.0, no early stop, exactly `new_tokens` new tokens (min = max decoding
        length)."""
        self._pipe.send(([[str(i) for i in row] for row in sources], num_beams, new_tokens))
        return self._pipe.recv()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the worker (continued, it reads None and returns; killed if it does not); again does nothing."""
        if self.process.is_alive():
            self.send_signal(signal.SIGCONT)  # a stopped worker reads nothing
            self._pipe.send(None)
            self.process.join(WORKER_STOP_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()


class ThreadChoice:
    """CTranslate2 at the faster of its thread settings for each batch size, as a user tuning `intra_threads` would
    configure it: one `Worker` per setting (1 intra-op thread, and every core), and at the first call of each batch
    size each is timed on that call's sources (`PROBES` runs apiece, interleaved, medians; in the harness this
    happens in the untimed warm-up), the faster kept for every later call of that size (`choices`).

    Why: its OpenMP team at batch 1 on 2 cores. `bench/ct2_settings.py` on an Intel Xeon (AVX-512 VNNI, AMX), 2
    cores, beam 4, medians of 3: int8 at batch 1 18.2 sentences/s on 2 threads and 41.5 on 1 (float32 16.2 on 2),
    at batch 16 94.2 and 100.1; no other setting (MKL or oneDNN, packed GEMM, the ISA, the OpenMP wait policy)
    changed batch 1 beyond the rounds' spread (docs/benchmarks.md). CTranslate2's own documentation shows CPU
    translators of `intra_threads=1` per worker."""

    PROBES = 3

    def __init__(self, folder: Path, compute_type: str, threads: int):
        settings = sorted({1, threads})
        self.workers = {n: Worker(folder, compute_type, n) for n in settings}
        self.choices: dict[int, dict] = {}  # batch size -> {"threads": n, "median_s": {n: seconds}}

    def translate(self, sources: list[list[int]], num_beams: int, new_tokens: int) -> list[list[int]]:
        batch = len(sources)
        if batch in self.choices:
            return self.workers[self.choices[batch]["threads"]].translate(sources, num_beams, new_tokens)
        times: dict[int, list[float]] = {n: [] for n in self.workers}
        answers = {}
        for _ in range(self.PROBES):
            for n, worker in self.workers.items():
                started = time.perf_counter()
                answers[n] = worker.translate(sources, num_beams, new_tokens)
                times[n].append(time.perf_counter() - started)
        medians = {n: statistics.median(t) for n, t in times.items()}
        fastest = min(medians, key=medians.get)
        self.choices[batch] = {"threads": fastest, "median_s": medians}
        return answers[fastest]

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def run_ctranslate2_translation(spec: TranslationSpec, runtime: Runtime, workdir: Path,
                                compute_type: str = "float32") -> GenerateFn:
    """CTRANSLATE2, TRANSLATION: `ctranslate2.Translator.translate_batch` on our translator's weights (random,
    seed 0, as ours), in `Worker`s of its own at the faster thread setting per batch size (`ThreadChoice`,
    printed as the case's `intra_threads` line): beam search like ours, `spec.num_beams`, exactly `spec.new_tokens`
    new tokens (see `Worker.translate`)."""
    from models.transformer import EncoderDecoderTransformer

    config = translation_config(spec)
    seed_torch(0)
    model = EncoderDecoderTransformer(config).eval()
    folder = convert(model, spec_dir(workdir, f"ctranslate2-translation-{compute_type}", spec))
    workers = ThreadChoice(folder, compute_type, runtime.threads)

    def generate(source: np.ndarray) -> np.ndarray:
        return np.array(workers.translate(source_rows(source), spec.num_beams, spec.new_tokens), dtype=np.int64)

    generate.thread_choices = workers.choices  # read by the report (`enginebench.report`)
    return generate


def agreement(ours: GenerateFn, theirs: GenerateFn, sources: list[np.ndarray]) -> dict:
    """How many best beams CTranslate2 and ours give alike on `sources`, token for token."""
    same = sum(np.array_equal(ours(s), theirs(s)) for s in sources)
    return {"identical": same, "sources": len(sources)}
