"""A version's variant as its config.json states it (`ModelVersion.variant`, reported by /v1/models and the
`tserve_model_info` metric): the keys the export writes, the plain float32 export where a config has none of them
(the first exports), and no KV cache for the image model."""

from pathlib import Path

import pytest

from service.repository import ModelVersion


@pytest.mark.parametrize("config, variant", [
    ({"kind": "gpt", "weights": "int8", "attention": "mha", "kv_cache": "inplace"},
     {"weights": "int8", "attention": "mha", "kv_cache": "inplace"}),
    ({"kind": "translation", "weights": "fp16", "attention": "mha"},
     {"weights": "fp16", "attention": "mha", "kv_cache": "concat"}),
    ({"kind": "gpt"}, {"weights": "fp32", "attention": "plain", "kv_cache": "concat"}),
    ({"kind": "vit", "weights": "int8", "attention": "mha", "kv_cache": "concat"},
     {"weights": "int8", "attention": "mha"}),
    ({"kind": "vit"}, {"weights": "fp32", "attention": "plain"}),
])
def test_the_variant_is_what_the_config_says_with_the_plain_export_as_default(config, variant):
    assert ModelVersion("m", 1, Path("m/1"), config).variant == variant
