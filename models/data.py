"""Dataset loading for the three models (numpy only; the training code wraps these in torch).

Data sources (none of it is shipped with the project; ``make data`` / ``python -m models.data fetch`` downloads
and verifies it, see :mod:`models.fetch`; point ``--data-dir`` or ``TSERVE_DATA_DIR`` at a folder laid out as below):

- ``multi30k/{train,val,test_2016_flickr}.{de,en}.gz``: Multi30k task 1, raw cased text, one sentence per line,
  gzip, line-aligned German/English. GitHub ``multi30k/dataset``, ``data/task1/raw/``. Research and educational
  use (derived from Flickr30K); cite Elliott et al. 2016.
- ``tinyshakespeare/input.txt``: 1,115,394 characters of Shakespeare. GitHub ``karpathy/char-rnn``,
  ``data/tinyshakespeare/input.txt``. Public-domain text.
- ``fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``: Fashion-MNIST in IDX format, gzip.
  Zalando Research, GitHub ``zalandoresearch/fashion-mnist`` (or Debian package ``dataset-fashion-mnist``). MIT.

The layout (file names, splits, sources) and :class:`~models.datasets.DataError` live in :mod:`models.datasets`, which
the fetcher shares; every missing or malformed file raises DataError with the expected path, format and source.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np

from models.datasets import (
    ENV_VAR,
    FASHION_MNIST_SOURCE,
    FASHION_MNIST_SPLITS,
    MULTI30K_SOURCE,
    MULTI30K_SPLITS,
    SHAKESPEARE_SOURCE,
    DataError,
)

_HINT = f"set --data-dir or {ENV_VAR}, or download the data with `make data` (python -m models.data fetch)"

FASHION_MNIST_LABELS = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)

SHAKESPEARE_TRAIN_FRACTION = 0.9  # the first 90% of the characters train, the rest validates (nanoGPT's split)
_IDX_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dims
_IDX_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dim
_READ_ERRORS = (OSError, EOFError, ValueError, zlib.error)  # gzip.BadGzipFile is an OSError


def _error(path: Path, expected: str, source: str, problem: str) -> DataError:
    return DataError(f"{problem}: expected {expected} at {path} ({source}); {_HINT}")


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Data folder: explicit argument, else $TSERVE_DATA_DIR, else ../shared/data (if it exists), else ./data."""
    if data_dir is not None:
        tried = [("argument", Path(data_dir))]
    elif os.environ.get(ENV_VAR):
        tried = [(ENV_VAR, Path(os.environ[ENV_VAR]))]
    else:
        tried = [("default", Path("../shared/data")), ("default", Path("data"))]
    for _, path in tried:
        if path.is_dir():
            return path.resolve()
    names = ", ".join(f"{path.absolute()} ({how})" for how, path in tried)
    raise DataError(f"data folder not found; tried {names}; {_HINT}")


def _read_gzip_bytes(path: Path, expected: str, source: str) -> bytes:
    if not path.is_file():
        raise _error(path, expected, source, "file not found")
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except _READ_ERRORS as e:
        raise _error(path, expected, source, f"cannot read gzip file ({e})") from e


def _read_gzip_lines(path: Path, expected: str, source: str) -> list[str]:
    raw = _read_gzip_bytes(path, expected, source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _error(path, expected, source, f"not UTF-8 text ({e})") from e
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # trailing newline
    return [line.strip() for line in lines]


def load_multi30k(data_dir: str | os.PathLike | None, split: str) -> list[tuple[str, str]]:
    """(German, English) sentence pairs of a Multi30k split, whitespace-stripped."""
    if split not in MULTI30K_SPLITS:
        raise ValueError(f"unknown Multi30k split {split!r}; expected one of {MULTI30K_SPLITS}")
    folder = resolve_data_dir(data_dir) / "multi30k"
    sides = {}
    for lang, name in (("de", "German"), ("en", "English")):
        path = folder / f"{split}.{lang}.gz"
        expected = f"gzip text file with one {name} sentence per line"
        sides[lang] = (path, _read_gzip_lines(path, expected, MULTI30K_SOURCE))
    (de_path, de), (en_path, en) = sides["de"], sides["en"]
    if len(de) != len(en):
        raise DataError(
            f"line count mismatch: {de_path} has {len(de)} lines but {en_path} has {len(en)}; "
            f"expected line-aligned gzip text files ({MULTI30K_SOURCE}); {_HINT}"
        )
    return list(zip(de, en))


def load_shakespeare(data_dir: str | os.PathLike | None) -> tuple[str, str]:
    """(train, val) text: the first 90% of the characters and the last 10% (nanoGPT's split)."""
    path = resolve_data_dir(data_dir) / "tinyshakespeare" / "input.txt"
    expected = "UTF-8 plain text file"
    if not path.is_file():
        raise _error(path, expected, SHAKESPEARE_SOURCE, "file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except _READ_ERRORS as e:
        raise _error(path, expected, SHAKESPEARE_SOURCE, f"cannot read file ({e})") from e
    if not text:
        raise _error(path, expected, SHAKESPEARE_SOURCE, "file is empty")
    n = int(len(text) * SHAKESPEARE_TRAIN_FRACTION)
    return text[:n], text[n:]


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (gzip or raw): images uint8 (N, rows, cols) or labels uint8 (N,)."""
    path = Path(path)
    expected = "IDX file (magic 0x00000803 for uint8 images or 0x00000801 for uint8 labels), optionally gzip"
    if not path.is_file():
        raise _error(path, expected, FASHION_MNIST_SOURCE, "file not found")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except _READ_ERRORS as e:
        raise _error(path, expected, FASHION_MNIST_SOURCE, f"cannot read file ({e})") from e
    if len(raw) < 4:
        raise _error(path, expected, FASHION_MNIST_SOURCE, f"file too short ({len(raw)} bytes)")
    magic = int.from_bytes(raw[:4], "big")
    if magic not in (_IDX_IMAGES_MAGIC, _IDX_LABELS_MAGIC):
        raise _error(path, expected, FASHION_MNIST_SOURCE, f"wrong magic number 0x{magic:08x}")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise _error(path, expected, FASHION_MNIST_SOURCE, f"truncated header ({len(raw)} bytes)")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    size = int(np.prod(dims))
    if len(raw) != header + size:
        raise _error(
            path, expected, FASHION_MNIST_SOURCE,
            f"size mismatch: header says dims {dims} ({header + size} bytes) but file has {len(raw)} bytes",
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims).copy()


def load_fashion_mnist(data_dir: str | os.PathLike | None, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (N, 28, 28) and labels int64 (N,) for split "train" (60,000) or "test" (10,000)."""
    if split not in FASHION_MNIST_SPLITS:
        raise ValueError(f"unknown Fashion-MNIST split {split!r}; expected one of {tuple(FASHION_MNIST_SPLITS)}")
    folder = resolve_data_dir(data_dir) / "fashion-mnist"
    prefix = FASHION_MNIST_SPLITS[split]
    images_path = folder / f"{prefix}-images-idx3-ubyte.gz"
    labels_path = folder / f"{prefix}-labels-idx1-ubyte.gz"
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise _error(images_path, "IDX images of shape (N, 28, 28)", FASHION_MNIST_SOURCE,
                     f"wrong dims {images.shape}")
    if labels.ndim != 1:
        raise _error(labels_path, "IDX labels of shape (N,)", FASHION_MNIST_SOURCE, f"wrong dims {labels.shape}")
    if len(images) != len(labels):
        raise DataError(
            f"count mismatch: {images_path} has {len(images)} images but {labels_path} has {len(labels)} labels; "
            f"expected matching Fashion-MNIST IDX files ({FASHION_MNIST_SOURCE}); {_HINT}"
        )
    if labels.size and labels.max() >= len(FASHION_MNIST_LABELS):
        raise _error(labels_path, "IDX labels in 0..9", FASHION_MNIST_SOURCE, f"label {labels.max()} out of range")
    return images, labels.astype(np.int64)


def main(argv: list[str] | None = None) -> int:
    """`python -m models.data fetch ...` (download and verify the data) and `... checksums DIR`: see models.fetch."""
    from models.fetch import main as fetch_main

    return fetch_main(argv, prog="python -m models.data")


if __name__ == "__main__":
    raise SystemExit(main())
