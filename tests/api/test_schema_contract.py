"""The OpenAPI schema is the contract: schemathesis generates requests from the live server's `/openapi.json`
(valid ones, and ones that break the schema on purpose) and runs every check it has against the responses.

Schemathesis runs as its CLI against a real server process (uvicorn, the tiny models), with a fixed seed and a
bounded number of examples per operation, so that a run takes seconds and a failure reproduces. Two checks are
configured for what this API documents, in `SCHEMATHESIS_CONFIG` below, each with its reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

SEED = 20261130
MAX_EXAMPLES = 150  # per operation and phase: ~1,000 requests, about 10 s
TIMEOUT_S = 300
# The tiny GPT's context is 64 tokens; with at most 60 new tokens a short prompt fits.
KNOBS = {"max_text_chars": 300, "max_new_tokens": 60}

SCHEMATHESIS_CONFIG = """
# not_a_server_error: a 504 is the documented answer to a request whose `timeout_ms` is shorter than its work
# (schemathesis picks timeout_ms=1 often, the schema's minimum); every other 5xx is a failure.
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "504"]

# positive_data_acceptance: a request that conforms to the schema may still get, as documented,
# - 400: what a schema cannot state (a prompt whose tokens plus max_new_tokens exceed the model's context,
#   num_return_sequences above num_beams, base64 text that is not an image Pillow can decode);
# - 403: the repository routes (load / unload a model version) while model control is off (the default);
# - 404: model names are free strings, and a name that is not loaded is not found;
# - 429 / 504: a full queue, or a deadline shorter than the work.
# A 422 (what the schema forbids) or any 5xx other than 504 still fails the check.
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "403", "404", "429", "504"]
"""


def test_every_generated_request_gets_a_documented_answer(tiny_repository, tmp_path):
    server = ServerProcess("schema contract server", tiny_repository, tmp_path, **KNOBS).start()
    try:
        config = tmp_path / "schemathesis.toml"
        config.write_text(SCHEMATHESIS_CONFIG)
        command = [str(Path(sys.executable).with_name("schemathesis")), "--no-color", "--config-file", str(config),
                   "run", f"{server.url}/openapi.json", "--checks", "all", "--seed", str(SEED),
                   "--max-examples", str(MAX_EXAMPLES), "--workers", "1", "--generation-database", "none",
                   "--request-timeout", "30", "--phases", "examples,coverage,fuzzing"]  # no links: no stateful phase
        run = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]
        assert "Failures:" not in run.stdout and " passed" in run.stdout, run.stdout[-5_000:]
        assert server.proc.poll() is None
        problems = [r for r in server.log_records() if r.get("level") in ("error", "critical")]
        assert problems == [], problems[:5]
    finally:
        server.stop()
