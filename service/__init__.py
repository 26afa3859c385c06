"""transformer-serving: the server (no PyTorch). Its name and version, as pyproject.toml gives them, are what the
OpenAPI document and the Open Inference Protocol's server metadata report."""

NAME = "transformer-serving"
__version__ = "0.1.0"
