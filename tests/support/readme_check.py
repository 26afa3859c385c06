"""`make readme-check`: every `$ curl` example of the README and docs/api.md run against a server on the committed
release models, its output compared with the one printed. The ids and timestamps a response makes up (`id`,
`created`, `last_inference`, times in `ns`) are not compared; numbers are compared exactly unless `--rtol` says
otherwise (the outputs are the CPU's: docs/api.md, "Which outputs depend on the CPU"). Examples whose output
depends on the requests before them (metrics, statistics) are run and shown, not compared.

    .venv/bin/python -m tests.support.readme_check [--rtol 1e-6] [--variant auto] [--repository model_repository]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from service.client.launcher import ServiceProcess, clean_environment
from tests.support import ROOT
from tests.support.examples import Example, all_examples, first_url_path, label

# Fields a server makes up or measures per response: never equal between two runs (`reason`: a variant's timings).
MADE_UP = frozenset({"id", "created", "last_inference", "ns", "reason"})
# Outputs that count what the server did before (an example's, or the warm-up's): shown, not compared.
STATEFUL_PATHS = ("/metrics", "/stats")
COMMAND_TIMEOUT_S = 120
SSE_PREFIX = "data: "


def parsed(text: str) -> list:
    """An output as values: each line as JSON where it is (an SSE line's payload included), else as text."""
    values = []
    for line in text.splitlines():
        payload = line.removeprefix(SSE_PREFIX)
        try:
            values.append(json.loads(payload))
        except ValueError:
            values.append(line)
    return values


def streamed(values: list) -> list:
    """An SSE stream as what it means, whatever the chunking (a stream sends the steps that became final while the
    client read the last event together): the text of its events joined, then its last event."""
    events = [v for v in values if isinstance(v, dict)]
    if len(events) < 2:
        return values
    pieces = []
    for event in events:
        choice = (event.get("choices") or [{}])[0]
        pieces.append(event.get("token") or choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return ["".join(pieces), events[-1]]


def same(shown, actual, rtol: float) -> bool:
    if isinstance(shown, dict) and isinstance(actual, dict):
        return shown.keys() == actual.keys() and all(
            key in MADE_UP or same(shown[key], actual[key], rtol) for key in shown)
    if isinstance(shown, list) and isinstance(actual, list):
        return len(shown) == len(actual) and all(same(a, b, rtol) for a, b in zip(shown, actual))
    if isinstance(shown, float) or isinstance(actual, float):
        return (isinstance(actual, int | float) and isinstance(shown, int | float)
                and math.isclose(shown, actual, rel_tol=rtol, abs_tol=0.0))
    return shown == actual


def run_example(example: Example, port: int, workdir: Path) -> str:
    command = example.command.replace("localhost:8000", f"127.0.0.1:{port}")
    result = subprocess.run(["bash", "-c", command], cwd=workdir, capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT_S, env=clean_environment())
    return (result.stdout + result.stderr).rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", default=str(ROOT / "model_repository"))
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance of numbers (default: exact)")
    parser.add_argument("--variant", default="auto",
                        help="TSERVE_VARIANT (the docs' outputs: gpt=int8+gqa+kv8,translation=int8,vit=fp32)")
    args = parser.parse_args(argv)
    differing = 0
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        subprocess.run([sys.executable, "-m", "models.example_images"], cwd=workdir, check=True,
                       env=clean_environment())
        with ServiceProcess("readme-check", args.repository, ready_timeout=600, variant=args.variant) as server:
            for example in all_examples():
                actual = run_example(example, server.port, workdir)
                stateful = first_url_path(example.command).endswith(STATEFUL_PATHS)
                if stateful:
                    verdict = "shown (depends on the requests before it)"
                elif same(streamed(parsed(example.output)), streamed(parsed(actual)), args.rtol):
                    verdict = "same"
                else:
                    verdict, differing = "DIFFERS", differing + 1
                print(f"{label(example)}: {verdict}")
                if verdict != "same":
                    print(f"  printed: {example.output[:2000]}\n  now:     {actual[:2000]}")
    print(f"{differing} of {len(all_examples())} examples differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
