"""The test harness the test modules share (no tests here; pytest collects none of these files).

- `server`: `ServerProcess`, a real `python -m service` in a subprocess with the tests' defaults, and the output
  of the servers a failing test used (tests/conftest.py builds the `server_factory` fixture and the autouse
  printer on it);
- `app`: the app in-process (a TestClient once ready; conftest's `serving`);
- `metrics`: a server's `/metrics` samples, summed by name and labels;
- `waiting`: a bounded poll for a condition;
- `repository`: private copies of the tiny model repository's versions (conftest's `tiny_repository_copy`);
- `images`: pixel arrays as PNG bytes;
- `fake_decoding`: a numpy decoding backend for the scheduler and batch tests; `batchers`: the continuous batcher
  on it (limits, a text job, a request held at a step);
- `deploy`: the deployment tests' tools (nginx, prometheus, docker-compose) and config rendering;
- `docker`: the Docker Engine API for the tests that run the built images, and why they cannot run here;
- `skips`: the end-of-session list of skipped tests and, under CI, the allowlist a skip must be on.

Paths are found from these files (`ROOT`, the repository root), never from the caller, so a test module may live
in any folder under tests/.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
