"""`python -m service.batch -i requests.jsonl -o results.jsonl`: an offline batch job (vLLM's `run-batch`, OpenAI's
Batch files), or with `--text` plain-text translation (CTranslate2's `translate_file`); `-` is standard input or
output. No server and no socket: the service's own app runs in this process (`service.batch.asgi`), with its
lifespan (models, schedulers), and each line is one request through it. So every output line is what the HTTP API
answers for the same request, by construction: the same validation, routes, serving calls, schedulers and engines.

Settings are the server's (TSERVE_*), less what a local job does not use: no gRPC port, no API keys (nothing comes
from outside), each request's deadline, unless it sets `timeout_ms`, the longest allowed (TSERVE_MAX_TIMEOUT_MS):
a batch has no client waiting, and the variants timed at the largest batch only (TSERVE_CALIBRATE_FOR=throughput:
a job keeps its batches full), so `auto` may choose another variant than a server's on the same host; pin
TSERVE_VARIANT to the server's choice for byte-identical answers. A rerun with the same output file appends what is missing; Ctrl-C leaves complete
lines. Exit status: 0 done, 1 lines left untranslated (--text), 2 bad usage or settings, 3 no model loaded, 130
interrupted. docs/batch.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from service.__main__ import EXIT_BAD_CONFIGURATION, bad_configuration
from service.api.native.protocol import request_models
from service.batch.asgi import running_app
from service.batch.job import DEFAULT_MAX_IN_FLIGHT
from service.batch.outputs import STDIO, OutputProblem, done_keys, open_output, resumed_lines
from service.batch.progress import SUMMARY_PREFIX
from service.batch.requests_file import run_requests
from service.batch.text_file import OptionsProblem, check_options, run_text
from service.observability.logs import configure_logging
from service.repository import TRANSLATION
from service.settings import Settings, SettingsInvalid, load_settings

EXIT_LINES_FAILED = 1
EXIT_NO_MODEL = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a job stopped by Ctrl-C
DEFAULT_LOG_LEVEL = "WARNING"  # the service's own log lines; INFO would add one access line per request


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m service.batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("-i", "--input-file", required=True,
                        help="requests (JSONL), or sentences with --text; - = stdin")
    parser.add_argument("-o", "--output-file", required=True, help="results (JSONL), or translations with --text; "
                        "- = stdout. An existing file is resumed: what it answers is skipped, the rest appended")
    parser.add_argument("--text", action="store_true", help="plain-text translation: a German sentence per line in, "
                        "its English translation per line out")
    parser.add_argument("-O", "--option", action="append", default=[], metavar="NAME=VALUE",
                        help="--text: a /v1/translate field for every sentence (num_beams=4, length_penalty=0.6, "
                             "model=translation, ...); VALUE is read as JSON, else as a string")
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT, metavar="N",
                        help=f"requests in the app at once (default {DEFAULT_MAX_IN_FLIGHT}; at most "
                             "TSERVE_MAX_QUEUE_SIZE)")
    parser.add_argument("--overwrite", action="store_true", help="start the output file afresh instead of resuming")
    parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                        help="the progress bar on stderr (auto: when stderr is a terminal)")
    parser.add_argument("--log-level", default=DEFAULT_LOG_LEVEL, help="the service's log lines, on stderr")
    args = parser.parse_args(argv)
    if args.max_in_flight < 1:
        parser.error("--max-in-flight must be at least 1")
    if args.option and not args.text:
        parser.error("-O/--option is for --text; a requests file sets each request's fields in its body")
    try:
        args.options = dict(_option(text) for text in args.option)
    except ValueError as error:
        parser.error(str(error))
    return args


def _option(text: str) -> tuple[str, object]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise ValueError(f"-O {text!r}: expected NAME=VALUE")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def job_settings(settings: Settings, args: argparse.Namespace) -> Settings:
    """The server's settings as a local job runs them (the module docstring says why each)."""
    update = {"grpc_port": 0, "api_keys": [], "api_keys_file": None, "default_timeout_ms": settings.max_timeout_ms,
              "calibrate_for": "throughput"}
    if args.text and not settings.models:  # the translator alone: no time spent loading the others
        model, version = args.options.get("model") or TRANSLATION, args.options.get("version")
        update["models"] = [f"{model}:{version}" if version else str(model)]
    return settings.model_copy(update=update)


def main(argv: list[str] | None = None, settings: Settings | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = job_settings(settings or load_settings(), args)
    except SettingsInvalid as error:
        bad_configuration(error)
    configure_logging(args.log_level, settings.log_format)
    logging.getLogger().handlers[0].setStream(sys.stderr)  # stdout may be the job's output
    try:
        if args.text:
            check_options(args.options, request_models(settings).translate)
        data = sys.stdin.buffer.read() if args.input_file == STDIO else Path(args.input_file).read_bytes()
        existing = resumed_lines(args.output_file, args.overwrite)
        done = set() if args.text else done_keys(args.output_file, existing)
        out = open_output(args.output_file, args.overwrite)
    except (OptionsProblem, OutputProblem) as error:
        return _usage(str(error))
    except OSError as error:
        return _usage(f"{error.filename}: {error.strerror}")
    base = Path.cwd() if args.input_file == STDIO else Path(args.input_file).parent
    show = {"auto": None, "on": True, "off": False}[args.progress]
    window = min(args.max_in_flight, settings.max_queue_size)

    async def job() -> int:
        async with running_app(settings) as app:
            if not app.state.registry.loaded:
                sys.stderr.write(f"{SUMMARY_PREFIX}no model loaded: {'; '.join(app.state.registry.readiness()[1])}\n")
                return EXIT_NO_MODEL
            if args.text:
                failed = await run_text(app, data, len(existing), args.options, out, window, show)
                return EXIT_LINES_FAILED if failed else 0
            await run_requests(app, data, done, out, base, window, show)
            return 0

    try:
        return asyncio.run(job())
    except KeyboardInterrupt:
        sys.stderr.write(f"{SUMMARY_PREFIX}interrupted: {args.output_file} holds complete lines; run the same "
                         "command again to do the rest\n")
        return EXIT_INTERRUPTED
    finally:
        if out is not sys.stdout:
            out.close()


def _usage(message: str) -> int:
    sys.stderr.write(f"{SUMMARY_PREFIX}{message}\n")
    return EXIT_BAD_CONFIGURATION


if __name__ == "__main__":
    sys.exit(main())
