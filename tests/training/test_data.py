"""Dataset loaders: the committed fixtures and the full sets (when present), the fixtures' provenance, and error
cases."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from models.data import (
    FASHION_MNIST_LABELS,
    MULTI30K_SPLITS,
    DataError,
    load_fashion_mnist,
    load_multi30k,
    load_shakespeare,
    read_idx,
    resolve_data_dir,
)

# --- real data: the fixtures (always) and the full sets (skipped unless present) -----------------------------------

# what each folder holds; the fixtures are the first N of every split (tests/fixtures/make_fixtures.py)
EXPECTED = {
    "fixtures": {
        "multi30k": {"train": 1_000, "val": 300, "test_2016_flickr": 300},
        "shakespeare_chars": 100_000, "shakespeare_distinct": 61,
        "fashion_labels": {"train": [52, 54, 47, 49, 53, 51, 53, 49, 50, 42],
                           "test": [55, 52, 65, 46, 57, 39, 47, 47, 44, 48]},
    },
    "full": {
        "multi30k": {"train": 29_000, "val": 1_014, "test_2016_flickr": 1_000},
        "shakespeare_chars": 1_115_394, "shakespeare_distinct": 65,
        "fashion_labels": {"train": [6_000] * 10, "test": [1_000] * 10},
    },
}


@pytest.fixture(params=["fixtures", "full"])
def dataset(request) -> tuple[Path, dict]:
    """(folder, what it holds): tests/fixtures/data, then the full data sets (skipped when absent)."""
    folder = request.getfixturevalue("data_dir" if request.param == "fixtures" else "full_data_dir")
    return folder, EXPECTED[request.param]


@pytest.mark.parametrize("split", MULTI30K_SPLITS)
def test_multi30k_counts(dataset, split):
    folder, expected = dataset
    pairs = load_multi30k(folder, split)
    assert len(pairs) == expected["multi30k"][split]
    assert all(de and en and de == de.strip() and en == en.strip() for de, en in pairs)


def test_multi30k_first_pairs(dataset):
    folder, _ = dataset
    assert load_multi30k(folder, "train")[0] == (
        "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
        "Two young, White males are outside near many bushes.",
    )
    assert load_multi30k(folder, "val")[0] == (
        "Eine Gruppe von Männern lädt Baumwolle auf einen Lastwagen",
        "A group of men are loading cotton onto a truck",
    )
    assert load_multi30k(folder, "test_2016_flickr")[0] == (
        "Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.",
        "A man in an orange hat starring at something.",
    )


def test_multi30k_bad_split(data_dir):
    assert MULTI30K_SPLITS == ("train", "val", "test_2016_flickr")
    with pytest.raises(ValueError, match="test_2016_flickr"):
        load_multi30k(data_dir, "test")


def test_shakespeare_split(dataset):
    folder, expected = dataset
    train, val = load_shakespeare(folder)
    n = expected["shakespeare_chars"]
    assert len(train) + len(val) == n
    assert len(train) == int(0.9 * n) and len(val) == n - int(0.9 * n)  # as in nanoGPT: full 1,003,854 + 111,540
    assert train.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")
    assert len(set(train + val)) == expected["shakespeare_distinct"]


@pytest.mark.parametrize("split", ["train", "test"])
def test_fashion_mnist(dataset, split):
    folder, expected = dataset
    images, labels = load_fashion_mnist(folder, split)
    count = sum(expected["fashion_labels"][split])
    assert images.shape == (count, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (count,) and labels.dtype == np.int64
    assert labels.min() == 0 and labels.max() == 9
    assert np.bincount(labels).tolist() == expected["fashion_labels"][split]
    assert images.max() == 255 and images.min() == 0
    assert len(FASHION_MNIST_LABELS) == 10 and FASHION_MNIST_LABELS[9] == "Ankle boot"


def test_fashion_mnist_bad_split(data_dir):
    with pytest.raises(ValueError):
        load_fashion_mnist(data_dir, "t10k")


def test_fixtures_are_what_make_fixtures_makes_from_the_full_sets(full_data_dir, data_dir, tmp_path):
    """The committed fixtures are reproducible: the script, run on the full sets, gives the same content (compared
    decompressed, so another zlib's different gzip bytes do not matter) and no other file."""
    spec = importlib.util.spec_from_file_location("make_fixtures", data_dir.parent / "make_fixtures.py")
    make_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fixtures)
    made = make_fixtures.make(full_data_dir, tmp_path)
    committed = sorted(p.relative_to(data_dir).as_posix() for p in data_dir.rglob("*") if p.is_file())
    assert sorted(made) == committed

    def content(path: Path) -> bytes:
        return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()

    for name in made:
        assert content(tmp_path / name) == content(data_dir / name), name


# --- data folder resolution ------------------------------------------------------------------------------------


def test_resolve_explicit_and_env(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("TSERVE_DATA_DIR", str(tmp_path / "b"))
    assert resolve_data_dir(tmp_path / "a") == (tmp_path / "a").resolve()
    assert resolve_data_dir() == (tmp_path / "b").resolve()


def test_resolve_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("TSERVE_DATA_DIR", raising=False)
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    monkeypatch.chdir(project)
    assert resolve_data_dir() == (project / "data").resolve()
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert resolve_data_dir() == (tmp_path / "shared" / "data").resolve()


def test_missing_folder(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="TSERVE_DATA_DIR") as err:
        resolve_data_dir(missing)
    assert str(missing) in str(err.value)
    monkeypatch.setenv("TSERVE_DATA_DIR", str(missing))
    with pytest.raises(DataError) as err:
        load_shakespeare(None)
    assert str(missing) in str(err.value)
    monkeypatch.delenv("TSERVE_DATA_DIR")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as err:
        resolve_data_dir()
    assert "shared" in str(err.value) and str(tmp_path / "data") in str(err.value)


# --- malformed files ---------------------------------------------------------------------------------------------


def _write_gz(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data))
    return path


def _idx(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    return magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims) + payload


def _assert_data_error(fn, path: Path, *args):
    with pytest.raises(DataError) as err:
        fn(*args)
    assert str(path) in str(err.value), str(err.value)
    return str(err.value)


def test_missing_file(tmp_path):
    root = tmp_path.resolve()
    msg = _assert_data_error(load_multi30k, root / "multi30k" / "train.de.gz", root, "train")
    assert "gzip text file with one German sentence per line" in msg and "multi30k/dataset" in msg
    _assert_data_error(load_shakespeare, root / "tinyshakespeare" / "input.txt", root)
    _assert_data_error(load_fashion_mnist, root / "fashion-mnist" / "t10k-images-idx3-ubyte.gz", root, "test")
    _write_gz(root / "multi30k" / "val.de.gz", b"Hallo\n")
    _assert_data_error(load_multi30k, root / "multi30k" / "val.en.gz", root, "val")


def test_not_gzip(tmp_path):
    root = tmp_path.resolve()
    path = root / "multi30k" / "train.de.gz"
    path.parent.mkdir()
    path.write_text("plain text, not gzip\n")
    _write_gz(root / "multi30k" / "train.en.gz", b"hello\n")
    msg = _assert_data_error(load_multi30k, path, root, "train")
    assert "gzip" in msg


def test_truncated_gzip_stream(tmp_path):
    root = tmp_path.resolve()
    path = _write_gz(root / "multi30k" / "val.de.gz", "Ein Satz.\n".encode() * 1000)
    _write_gz(root / "multi30k" / "val.en.gz", b"A sentence.\n" * 1000)
    path.write_bytes(path.read_bytes()[:30])
    _assert_data_error(load_multi30k, path, root, "val")


def test_not_utf8(tmp_path):
    root = tmp_path.resolve()
    path = _write_gz(root / "multi30k" / "val.de.gz", b"M\xe4nner\n")  # latin-1
    _write_gz(root / "multi30k" / "val.en.gz", b"men\n")
    _assert_data_error(load_multi30k, path, root, "val")


def test_line_count_mismatch(tmp_path):
    root = tmp_path.resolve()
    de = _write_gz(root / "multi30k" / "val.de.gz", "Eins.\nZwei.\nDrei.\n".encode())
    en = _write_gz(root / "multi30k" / "val.en.gz", b"One.\nTwo.\n")
    msg = _assert_data_error(load_multi30k, de, root, "val")
    assert str(en) in msg and "3" in msg and "2" in msg


def test_multi30k_small_ok(tmp_path):
    root = tmp_path.resolve()
    _write_gz(root / "multi30k" / "val.de.gz", "  Zwei Männer. \r\nEin Hund.\n".encode())
    _write_gz(root / "multi30k" / "val.en.gz", b"Two men.\r\nA dog.")  # no trailing newline
    assert load_multi30k(root, "val") == [("Zwei Männer.", "Two men."), ("Ein Hund.", "A dog.")]


def test_read_idx_ok_raw_and_gzip(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = tmp_path / "images-idx3-ubyte"
    raw.write_bytes(_idx(0x803, (2, 3, 4), images.tobytes()))
    gz = _write_gz(tmp_path / "labels-idx1-ubyte.gz", _idx(0x801, (3,), bytes([7, 8, 9])))
    np.testing.assert_array_equal(read_idx(raw), images)
    labels = read_idx(gz)
    assert labels.dtype == np.uint8 and labels.tolist() == [7, 8, 9]


def test_truncated_idx(tmp_path):
    path = _write_gz(tmp_path / "x-images-idx3-ubyte.gz", _idx(0x803, (10, 28, 28), bytes(28 * 28 * 9)))
    msg = _assert_data_error(read_idx, path, path)
    assert "size mismatch" in msg
    short = _write_gz(tmp_path / "short.gz", _idx(0x803, (10,), b""))  # header cut after the first dim
    _assert_data_error(read_idx, short, short)
    tiny = _write_gz(tmp_path / "tiny.gz", b"\x00\x00")
    _assert_data_error(read_idx, tiny, tiny)


def test_wrong_magic(tmp_path):
    path = _write_gz(tmp_path / "x-images-idx3-ubyte.gz", _idx(0x2051_0000, (1, 28, 28), bytes(784)))
    msg = _assert_data_error(read_idx, path, path)
    assert "magic" in msg and "fashion-mnist" in msg.lower()
    floats = _write_gz(tmp_path / "floats.gz", _idx(0x0D01, (1,), bytes(4)))  # float32 IDX: not supported
    _assert_data_error(read_idx, floats, floats)


def _fashion(root: Path, split_prefix: str, images: np.ndarray, labels: np.ndarray) -> tuple[Path, Path]:
    ip = _write_gz(root / "fashion-mnist" / f"{split_prefix}-images-idx3-ubyte.gz",
                   _idx(0x803, images.shape, images.tobytes()))
    lp = _write_gz(root / "fashion-mnist" / f"{split_prefix}-labels-idx1-ubyte.gz",
                   _idx(0x801, labels.shape, labels.tobytes()))
    return ip, lp


def test_fashion_count_mismatch(tmp_path):
    root = tmp_path.resolve()
    ip, lp = _fashion(root, "t10k", np.zeros((3, 28, 28), np.uint8), np.zeros(2, np.uint8))
    msg = _assert_data_error(load_fashion_mnist, ip, root, "test")
    assert str(lp) in msg


def test_fashion_wrong_dims_and_labels(tmp_path):
    root = tmp_path.resolve()
    ip, _ = _fashion(root, "t10k", np.zeros((2, 32, 32), np.uint8), np.zeros(2, np.uint8))
    _assert_data_error(load_fashion_mnist, ip, root, "test")
    _, lp = _fashion(root, "t10k", np.zeros((2, 28, 28), np.uint8), np.array([1, 10], np.uint8))
    _assert_data_error(load_fashion_mnist, lp, root, "test")
    _fashion(root, "train", np.zeros((2, 28, 28), np.uint8), np.array([0, 9], np.uint8))
    images, labels = load_fashion_mnist(root, "train")
    assert images.shape == (2, 28, 28) and labels.tolist() == [0, 9] and labels.dtype == np.int64
