"""What an operator runs from the README works as written, on a bare host:

- `make compose-up` / `compose-down` / `compose`: `docker compose` (v2) when the Docker CLI has it, else
  docker-compose (v1), always under the project name `tserve` and, by default, on the registry-free files of
  `make images` (fake docker and docker-compose on PATH record what make ran; no daemon needed);
- the compose stack's Prometheus entrypoint (deploy/prometheus/entrypoint.sh) writes the expected replica count,
  TSERVE_EXPECTED_REPLICAS else TSERVE_REPLICAS, into its copy of replicas.yml (a fake `prometheus` records what
  it was started with; promtool checks the copy), and refuses a count that is not a whole number;
- the README's example images (`ankle_boot.png`, `pullover.png`) are written by the command the README gives,
  from the data folder or, without one, from the committed fixtures;
- docs/api.md's "Rolling a model version without a restart" block, run for real command by command in a copy of
  the committed repository (never model_repository/ itself), gives the outputs it shows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from models.data import load_fashion_mnist
from service.client.launcher import ServiceProcess, clean_environment
from tests.support.deploy import require_tool
from tests.support import ROOT

README = ROOT / "README.md"
API_DOC = ROOT / "docs" / "api.md"  # the full examples: the README shows one per API
ENTRYPOINT = ROOT / "deploy" / "prometheus" / "entrypoint.sh"
REGISTRY_FREE_FILES = "-f docker-compose.yml -f docker-compose.test.yml"


def fake_tool(folder: Path, name: str, body: str) -> None:
    """An executable `name` in folder: appends "name args..." to $FAKE_LOG, then runs body (sh)."""
    path = folder / name
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >> "$FAKE_LOG"\n{body}\n')
    path.chmod(0o755)


# --- make compose-up: v1 or v2 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tools, args, expected", [
    (("docker-v2", "docker-compose"), ["compose-up"],
     f"docker compose -p tserve {REGISTRY_FREE_FILES} up -d --no-build"),
    (("docker-v1-only", "docker-compose"), ["compose-up"],
     f"docker-compose -p tserve {REGISTRY_FREE_FILES} up -d --no-build"),
    (("docker-compose",), ["compose-down"], f"docker-compose -p tserve {REGISTRY_FREE_FILES} down"),
    (("docker-v2",), ["compose", "COMPOSE_ARGS=restart nginx"],
     f"docker compose -p tserve {REGISTRY_FREE_FILES} restart nginx"),
    (("docker-v2",), ["compose-up", "COMPOSE_FILES=docker-compose.yml", "COMPOSE_UP_ARGS=--build",
                      "COMPOSE_PROJECT=staging"], "docker compose -p staging -f docker-compose.yml up -d --build"),
    ((), ["compose-up"], None),
], ids=["v2-preferred", "v1-when-no-plugin", "v1-only", "any-command", "hub-images-other-project", "neither"])
def test_make_compose_targets_pick_v2_or_v1(tmp_path, tools, args, expected):
    make = shutil.which("make")
    if make is None:
        pytest.skip("`make` not found on PATH")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    if "docker-v2" in tools:
        fake_tool(bin_dir, "docker", "exit 0")  # `docker compose version` succeeds: the v2 plugin is there
    if "docker-v1-only" in tools:
        fake_tool(bin_dir, "docker", '[ "$1" = compose ] && { echo "docker: unknown command: docker compose" >&2; '
                                     'exit 1; }; exit 0')
    if "docker-compose" in tools:
        fake_tool(bin_dir, "docker-compose", "exit 0")
    result = subprocess.run([make, "-s", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60,
                            env={"PATH": str(bin_dir), "FAKE_LOG": str(log), "HOME": str(tmp_path)})
    calls = log.read_text().splitlines() if log.exists() else []
    ran = [call for call in calls if call != "docker compose version"]  # make's probe of the v2 plugin
    if expected is None:
        assert result.returncode != 0 and "neither `docker compose` (v2) nor docker-compose (v1) found" in result.stderr
        assert not ran, ran
    else:
        assert result.returncode == 0, result.stdout + result.stderr
        assert ran == [expected]


# --- the compose stack's Prometheus entrypoint ------------------------------------------------------------------


@pytest.mark.parametrize("env, expected", [
    ({}, 2),
    ({"TSERVE_REPLICAS": "3"}, 3),
    ({"TSERVE_REPLICAS": "3", "TSERVE_EXPECTED_REPLICAS": ""}, 3),  # compose passes the unset one as empty
    ({"TSERVE_REPLICAS": "0", "TSERVE_EXPECTED_REPLICAS": "1"}, 1),  # GPU replicas: --scale api=0
    ({"TSERVE_REPLICAS": "09"}, 9),
    ({"TSERVE_REPLICAS": "0"}, 0),
    ({"TSERVE_REPLICAS": "two"}, None),
    ({"TSERVE_REPLICAS": "-1"}, None),
    ({"TSERVE_REPLICAS": "2", "TSERVE_EXPECTED_REPLICAS": "2.5"}, None),
], ids=["default", "replicas", "empty-expected", "expected-wins", "leading-zero", "zero", "word", "negative",
        "fraction"])
def test_prometheus_entrypoint_writes_the_expected_replica_count(tmp_path, env, expected):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    config = tmp_path / "config"
    # the fake Prometheus records its arguments and the recording rule it would load
    fake_tool(bin_dir, "prometheus", f'cp "{config}/replicas.yml" "{tmp_path}/loaded-replicas.yml"')
    log = tmp_path / "calls.log"
    run_env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "FAKE_LOG": str(log),
               "TSERVE_PROMETHEUS_SOURCE": str(ENTRYPOINT.parent), "TSERVE_PROMETHEUS_CONFIG": str(config), **env}
    result = subprocess.run(["/bin/sh", str(ENTRYPOINT), "--storage.tsdb.path=/prometheus", "--web.enable-lifecycle"],
                            capture_output=True, text=True, timeout=60, env=run_env)
    if expected is None:
        assert result.returncode != 0 and "is not a whole number" in result.stderr, result.stderr
        assert not log.exists(), "Prometheus must not start with a wrong expected count"
        return
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines() == [
        f"prometheus --config.file={config}/prometheus.yml --storage.tsdb.path=/prometheus --web.enable-lifecycle"]
    rules = yaml.safe_load((tmp_path / "loaded-replicas.yml").read_text())
    (rule,) = [r for group in rules["groups"] for r in group["rules"]]
    assert rule == {"record": "tserve:replicas_expected", "expr": f"vector({expected})"}
    # the copy is the committed folder but for that number, and Prometheus accepts it
    for name in ("prometheus.yml", "alerts.yml"):
        assert (config / name).read_text() == (ENTRYPOINT.parent / name).read_text()
    promtool = require_tool("promtool")
    check = subprocess.run([promtool, "check", "config", str(config / "prometheus.yml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


# --- the README's example images --------------------------------------------------------------------------------


def readme_example_images() -> set[str]:
    """The image files the example requests of the README and docs/api.md send (curl -F files=@..., base64 ...,
    open(...))."""
    text = README.read_text() + API_DOC.read_text()
    return (set(re.findall(r"files=@([\w.-]+\.png)", text)) | set(re.findall(r"base64 -w0 ([\w.-]+\.png)", text))
            | {name for group in re.findall(r"open\(f, \"rb\"\).read\(\) for f in \(([^)]*)\)", text)
               for name in re.findall(r'"([\w.-]+\.png)"', group)})


def readme_example_images_command() -> list[str]:
    """The command the README gives for them, as an argument list (its `.venv/bin/python` this interpreter)."""
    commands = re.findall(r"`(\.venv/bin/python -m models\.example_images[^`]*)`", README.read_text())
    assert commands, "README.md gives no `.venv/bin/python -m models.example_images` command for its example images"
    return [sys.executable, *commands[0].split()[1:]]


@pytest.mark.parametrize("data_env", ["fixtures-explicit", "no-data-folder", "data-folder-without-images"])
def test_the_readme_example_images_come_from_the_command_it_gives(tmp_path, data_dir, data_env):
    names = readme_example_images()
    assert names == {"ankle_boot.png", "pullover.png"}, names
    command = readme_example_images_command()
    env = clean_environment()
    env.pop("TSERVE_DATA_DIR", None)
    if data_env == "fixtures-explicit":
        command += ["--data-dir", str(data_dir)]
    elif data_env == "data-folder-without-images":
        (tmp_path / "data" / "fashion-mnist").mkdir(parents=True)  # ./data exists, with no test set in it
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    from PIL import Image

    images, labels = load_fashion_mnist(data_dir, "test")
    for index, name in enumerate(("ankle_boot.png", "pullover.png")):  # "Fashion-MNIST test images 0 and 1"
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG" and image.mode == "L" and image.size == (28, 28)
            assert np.array_equal(np.asarray(image), images[index])
    assert list(labels[:2]) == [9, 2]  # Ankle boot, Pullover


def test_example_images_reject_an_index_outside_the_test_set(tmp_path, data_dir):
    result = subprocess.run([sys.executable, "-m", "models.example_images", "--data-dir", str(data_dir),
                             "--index", "0", "100000"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=clean_environment())
    assert result.returncode == 2 and "index 100000 is outside 0..499" in result.stderr
    assert not list(tmp_path.glob("*.png")), "nothing is written when an index is wrong"


# --- docs/api.md's "Rolling a model version without a restart", for real -----------------------------------------


def readme_rolling_steps() -> list[tuple[str, list[str]]]:
    """(command, the comment lines after it) of the bash block under docs/api.md's "Rolling a model version without a
    restart"."""
    text = API_DOC.read_text()
    section = text[text.index("## Rolling a model version without a restart"):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("#"):
            if steps:
                steps[-1][1].append(line.lstrip("# "))
        elif line.strip():
            steps.append((line, []))
    return steps


def expected_json(comment: str):
    """The JSON a README comment line starts with; a list written `[..., ...]` ends at its `, ...]`."""
    comment = comment.replace(", ...]", "]")
    value, _ = json.JSONDecoder().raw_decode(comment)
    return value


@pytest.mark.slow
def test_the_readme_rolling_example_runs_as_written(tmp_path, tiny_runs, data_dir):
    steps = readme_rolling_steps()
    server, *commands = steps
    assert server[0].split("#")[0].strip() == "TSERVE_MODEL_CONTROL=true make serve", server
    work = tmp_path / "checkout"  # what the README's paths are relative to: a checkout after `make serve`
    shutil.copytree(ROOT / "model_repository", work / "model_repository")
    (work / "tests" / "fixtures").mkdir(parents=True)
    (work / "tests" / "fixtures" / "data").symlink_to(data_dir)
    # the session's tiny GPT run: the README's training command then resumes a finished run (seconds)
    shutil.copytree(tiny_runs["gpt"], work / "runs" / "gpt-tiny")
    service = ServiceProcess("service", work / "model_repository", work, ready_timeout=180, intra_op_threads=1,
                             model_control="true", calibration_cache="")
    try:
        service.start()
        env = clean_environment()
        for command, comments in commands:
            runnable = command.split("  #")[0].replace(".venv/bin/python", sys.executable)
            runnable = runnable.replace("localhost:8000", f"127.0.0.1:{service.port}")
            result = subprocess.run(["bash", "-c", runnable], cwd=work, env=env, capture_output=True, text=True,
                                    timeout=300)
            assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
            if command.startswith("curl"):
                assert comments, f"docs/api.md shows no output for {command}"
                expected, actual = expected_json(comments[0]), json.loads(result.stdout)
                if isinstance(expected, list) and comments[0].rstrip().endswith(", ...]"):
                    actual = actual[:len(expected)]
                assert actual == expected, command
            elif comments and comments[0].startswith("exported "):
                assert result.stdout.strip().splitlines()[-1] == comments[0].strip(), command
        assert not (work / "model_repository" / "gpt" / "5").exists(), "the example cleans up what it added"
    except BaseException:
        print(service.output()[-20000:])
        raise
    finally:
        service.stop()
