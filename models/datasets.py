"""What the data folder holds: the three datasets, their splits and sources, each file's place in the folder and
upstream, the variable that names the folder, and the error every reader of it raises.

Both sides of the data import this module and nothing else of each other: :mod:`models.data` (the loaders, which
read the files) and :mod:`models.fetch` (which downloads and verifies them).
"""

from __future__ import annotations

from dataclasses import dataclass

ENV_VAR = "TSERVE_DATA_DIR"

DATASETS = ("multi30k", "tinyshakespeare", "fashion-mnist")
MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")
FASHION_MNIST_SPLITS = {"train": "train", "test": "t10k"}  # split -> the IDX files' name prefix

MULTI30K_SOURCE = "Multi30k task 1 raw, github.com/multi30k/dataset data/task1/raw"
SHAKESPEARE_SOURCE = "tinyshakespeare, github.com/karpathy/char-rnn data/tinyshakespeare/input.txt"
FASHION_MNIST_SOURCE = "Fashion-MNIST, github.com/zalandoresearch/fashion-mnist data/fashion"


class DataError(Exception):
    """A dataset folder or file is missing or malformed."""


@dataclass(frozen=True)
class DataFile:
    """One file: where the loaders read it (``path``, relative to the data folder; also its path on a mirror) and
    where it comes from upstream (``url``, gzip-compressed there or not)."""

    dataset: str
    path: str
    url: str
    upstream_gzip: bool

    @property
    def gzip(self) -> bool:
        """Whether the data folder (and a mirror) holds it gzip-compressed: the loaders' names say so."""
        return self.path.endswith(".gz")


_MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
_FASHION_URL = "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"

FILES: tuple[DataFile, ...] = (
    *(
        DataFile("multi30k", f"multi30k/{split}.{lang}.gz", f"{_MULTI30K_URL}{split}.{lang}.gz", upstream_gzip=True)
        for split in MULTI30K_SPLITS
        for lang in ("de", "en")
    ),
    DataFile("tinyshakespeare", "tinyshakespeare/input.txt", _SHAKESPEARE_URL, upstream_gzip=False),
    *(
        DataFile("fashion-mnist", f"fashion-mnist/{prefix}-{kind}-ubyte.gz", f"{_FASHION_URL}{prefix}-{kind}-ubyte.gz",
                 upstream_gzip=True)
        for prefix in FASHION_MNIST_SPLITS.values()
        for kind in ("images-idx3", "labels-idx1")
    ),
)
