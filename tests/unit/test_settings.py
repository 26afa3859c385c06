"""The configuration from the environment: list settings written either way an operator would, and a bad value
refused at start with a message naming its variable (exit status 2, no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.settings import SettingsInvalid, load_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("value", "expected"), [
    ("gpt", ["gpt"]),
    ("gpt,vit:4", ["gpt", "vit:4"]),
    (" gpt , translation:3 ,", ["gpt", "translation:3"]),
    ('["gpt","vit:4"]', ["gpt", "vit:4"]),
    ("", []),
])
def test_models_from_a_list_or_comma_separated_names(monkeypatch, value, expected):
    monkeypatch.setenv("TSERVE_MODELS", value)
    assert load_settings().models == expected


def test_the_response_cache_is_off_unless_models_are_named(monkeypatch):
    assert load_settings().response_cache == []
    monkeypatch.setenv("TSERVE_RESPONSE_CACHE", "translation,vit")
    assert load_settings().response_cache == ["translation", "vit"]


def test_api_keys_comma_separated(monkeypatch):
    monkeypatch.setenv("TSERVE_API_KEYS", "key-aaaaaaaaaaaaaaaa,key-bbbbbbbbbbbbbbbb")
    assert load_settings().api_keys == ["key-aaaaaaaaaaaaaaaa", "key-bbbbbbbbbbbbbbbb"]


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("TSERVE_MODELS", '["gpt"', "not a JSON list"),
    ("TSERVE_PORT", "eighty", "valid integer"),
    ("TSERVE_GPT_MAX_BATCH_ROWS", "0", "greater than or equal to 1"),
    ("TSERVE_VARIANT", "fastest", "bad TSERVE_VARIANT entry"),
    ("TSERVE_RESPONSE_CACHE", "none,gpt", "`none` stands alone"),
    ("TSERVE_RESPONSE_CACHE_REDIS_TIMEOUT_MS", "0", "greater than 0"),
    ("TSERVE_RESPONSE_CACHE_REDIS_URL", "http://cache:6379", "a Redis URL starts with redis://"),
    ("TSERVE_LOG_FORMAT", "xml", "'json' or 'text'"),
])
def test_a_bad_value_names_its_variable(monkeypatch, variable, value, says):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsInvalid) as caught:
        load_settings()
    message = str(caught.value)
    assert message.startswith(f"{variable}: ") and says in message and repr(value) in message


def test_every_bad_variable_is_reported_at_once(monkeypatch):
    monkeypatch.setenv("TSERVE_PORT", "eighty")
    monkeypatch.setenv("TSERVE_MAX_TEXTS", "-1")
    lines = str(pytest.raises(SettingsInvalid, load_settings).value).splitlines()
    assert sorted(line.split(":")[0] for line in lines) == ["TSERVE_MAX_TEXTS", "TSERVE_PORT"]


def test_the_server_refuses_a_bad_configuration_without_a_traceback():
    env = {**os.environ, "TSERVE_PORT": "eighty"}
    done = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "TSERVE_PORT: " in done.stderr and "'eighty'" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_calibration_step_refuses_a_bad_configuration_the_same_way(monkeypatch, capsys):
    from service.models.calibrate import main

    monkeypatch.setenv("TSERVE_GPT_MAX_BATCH_ROWS", "lots")
    assert main(["--pins"]) == 2
    assert "TSERVE_GPT_MAX_BATCH_ROWS: " in capsys.readouterr().err
