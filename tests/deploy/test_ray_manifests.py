"""deploy/ray/'s files agree with one another (no Ray needed; tests/deploy/test_ray_cluster.py runs them): the
RayService embeds serve_config.yaml (the image's model path aside), runs the Ray of requirements/ray.txt in the image
deploy/ray/Dockerfile builds, and gives its worker pods whole replicas' worth of CPUs."""

from __future__ import annotations

import re

import yaml

from tests.support import ROOT
from tests.support.locks import read_lock

RAY = ROOT / "deploy" / "ray"
IMAGE_MODELS = "/srv/model_repository"  # deploy/Dockerfile's TSERVE_REPOSITORY, which deploy/ray/Dockerfile keeps


def rayservice() -> dict:
    (service,) = yaml.safe_load_all((RAY / "rayservice.yaml").read_text())
    return service


def app_args(config: dict) -> dict:
    (app,) = config["applications"]
    return app["args"]


def test_the_rayservice_embeds_the_serve_config_with_the_images_model_path():
    embedded = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])
    config = yaml.safe_load((RAY / "serve_config.yaml").read_text())
    assert app_args(embedded)["repository"] == IMAGE_MODELS
    assert (ROOT / app_args(config)["repository"]).is_dir()  # relative to the checkout, where `serve run` runs
    app_args(embedded)["repository"] = app_args(config)["repository"]
    assert embedded == config


def test_the_rayservice_runs_the_locked_ray_in_the_ray_image():
    version = read_lock(ROOT / "requirements" / "ray.txt")["ray"].version
    spec = rayservice()["spec"]["rayClusterConfig"]
    assert spec["rayVersion"] == version
    templates = [spec["headGroupSpec"]["template"]] + [group["template"] for group in spec["workerGroupSpecs"]]
    images = {container["image"] for template in templates for container in template["spec"]["containers"]}
    assert images == {f"tserve-ray:{version}"}
    dockerfile = (RAY / "Dockerfile").read_text()
    assert f"-t tserve-ray:{version} " in dockerfile
    assert re.search(r"--require-hashes -r \S*ray\.txt", dockerfile)


def test_worker_pods_hold_whole_replicas_and_the_head_none():
    spec = rayservice()["spec"]["rayClusterConfig"]
    threads = app_args(yaml.safe_load(rayservice()["spec"]["serveConfigV2"]))["intra_op_threads"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group in spec["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        cpus = int(container["resources"]["limits"]["cpu"])
        assert cpus % threads == 0 and cpus >= threads, (cpus, threads)  # Ray counts the limit as the node's CPUs
        assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed, as deploy/k8s
