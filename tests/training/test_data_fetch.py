"""`python -m models.data fetch` against a local mirror (http.server in a thread, file://): no internet.

The mirror holds small fake files in the data folder's layout, valid for the loaders, with checksums of THOSE files
injected (the committed table is checked against the reference copies separately)."""

from __future__ import annotations

import gzip
import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

import models.fetch as fetch_module
from models.data import load_fashion_mnist, load_multi30k, load_shakespeare
from models.data_checksums import CHECKSUMS
from models.datasets import DATASETS, FILES, DataFile
from models.fetch import fetch, main
from models.fetch_verify import compute_checksums, content_digest, render_checksums_module
from tests.support import ROOT

PROJECT_ROOT = ROOT
SHAKESPEARE = "tinyshakespeare/input.txt"


# --- fake mirror ---------------------------------------------------------------------------------------------------


def _idx(magic: int, array: np.ndarray) -> bytes:
    return magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape) + array.tobytes()


def _fake_content() -> dict[str, bytes]:
    """Decompressed content of every file of the layout, small but loadable."""
    rng = np.random.default_rng(0)
    content = {}
    for split, n in (("train", 6), ("val", 3), ("test_2016_flickr", 2)):
        content[f"multi30k/{split}.de.gz"] = "".join(f"Satz {i} ({split}), Männer.\n" for i in range(n)).encode()
        content[f"multi30k/{split}.en.gz"] = "".join(f"Sentence {i} ({split}), men.\n" for i in range(n)).encode()
    # ~200 KB: several read chunks, so a cut-off transfer leaves a real partial file
    content[SHAKESPEARE] = "".join(f"CITIZEN {i}:\nSpeak, speak.\n\n" for i in range(8_000)).encode()
    for prefix, n in (("train", 20), ("t10k", 10)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        content[f"fashion-mnist/{prefix}-images-idx3-ubyte.gz"] = _idx(0x803, images)
        content[f"fashion-mnist/{prefix}-labels-idx1-ubyte.gz"] = _idx(0x801, labels)
    assert set(content) == {f.path for f in FILES}
    return content


def _stored(path: str, data: bytes) -> bytes:
    return gzip.compress(data, mtime=0) if path.endswith(".gz") else data


def _checksums(content: dict[str, bytes]) -> dict[str, dict]:
    return {p: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for p, d in content.items()}


class _Handler(BaseHTTPRequestHandler):
    """GET /<path> from server.files; honours `Range: bytes=N-` unless server.honour_range is False; cuts the body
    of a path in server.cut_once to half, once, after sending the full Content-Length."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        server = self.server
        path = self.path.lstrip("/")
        server.requests.append((path, self.headers.get("Range")))
        data = server.files.get(path)
        if data is None:
            self.send_error(404)
            return
        start, status = 0, 200
        header = self.headers.get("Range")
        if header and server.honour_range:
            start = int(header.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        body = data[start:]
        self.send_response(status)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if path in server.cut_once:
            server.cut_once.discard(path)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


class Mirror:
    def __init__(self, content: dict[str, bytes]):
        self.content = content
        self.checksums = _checksums(content)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.files = {p: _stored(p, d) for p, d in content.items()}
        self.server.requests = []
        self.server.honour_range = True
        self.server.cut_once = set()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @property
    def requests(self) -> list[tuple[str, str | None]]:
        return self.server.requests

    def fetch(self, data_dir: Path, **kwargs):
        lines: list[str] = []
        kwargs.setdefault("mirror", self.url)
        kwargs.setdefault("checksums", self.checksums)
        result = fetch(data_dir, retries=kwargs.pop("retries", 0), backoff=0, timeout=10, log=lines.append,
                       **kwargs)
        return result, lines

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def mirror(monkeypatch):
    monkeypatch.delenv("TSERVE_DATA_MIRROR", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    m = Mirror(_fake_content())
    yield m
    m.close()


def _assert_laid_out(root: Path, content: dict[str, bytes]) -> None:
    for path, data in content.items():
        assert (root / path).is_file(), path
        assert content_digest(root / path, path.endswith(".gz")) == (hashlib.sha256(data).hexdigest(), len(data))
    leftovers = [p for p in root.rglob("*") if p.suffix in (".part", ".tmp")]
    assert not leftovers, leftovers


# --- cases ---------------------------------------------------------------------------------------------------------


def test_fresh_fetch_lays_out_everything_for_the_loaders(mirror, tmp_path):
    root = tmp_path / "data"  # created by the fetch
    result, lines = mirror.fetch(root)
    assert result.ok, result.failed
    assert sorted(result.downloaded) == sorted(mirror.content) and result.present == []
    _assert_laid_out(root, mirror.content)
    assert len([line for line in lines if line.startswith("fetched")]) == len(FILES)
    # the layout is the loaders' layout
    assert load_multi30k(root, "val")[0] == ("Satz 0 (val), Männer.", "Sentence 0 (val), men.")
    assert len(load_multi30k(root, "train")) == 6 and len(load_multi30k(root, "test_2016_flickr")) == 2
    train, val = load_shakespeare(root)
    assert train.startswith("CITIZEN 0:") and val.endswith("Speak, speak.\n\n")
    images, labels = load_fashion_mnist(root, "train")
    assert images.shape == (20, 28, 28) and labels.tolist() == [i % 10 for i in range(20)]


def test_second_run_does_nothing(mirror, tmp_path):
    assert mirror.fetch(tmp_path)[0].ok
    requests = len(mirror.requests)
    mtimes = {p: (tmp_path / p).stat().st_mtime_ns for p in mirror.content}
    result, lines = mirror.fetch(tmp_path)
    assert result.ok and result.downloaded == [] and sorted(result.present) == sorted(mirror.content)
    assert len(mirror.requests) == requests  # no request at all
    assert {p: (tmp_path / p).stat().st_mtime_ns for p in mirror.content} == mtimes
    assert len(lines) == len(FILES) and all(line.startswith("ok") and "verified" in line for line in lines)


def test_only_one_dataset(mirror, tmp_path):
    result, _ = mirror.fetch(tmp_path, only=["tinyshakespeare"])
    assert result.ok and result.downloaded == [SHAKESPEARE]
    assert not (tmp_path / "multi30k").exists() and not (tmp_path / "fashion-mnist").exists()
    with pytest.raises(ValueError, match="imagenet"):
        mirror.fetch(tmp_path, only=["imagenet"])


def test_corrupted_file_on_the_mirror(mirror, tmp_path):
    bad = "multi30k/val.en.gz"
    mirror.server.files[bad] = gzip.compress(b"Sentence 0 (val), men.\nSomething else.\nAnd more.\n")
    result, _ = mirror.fetch(tmp_path)
    assert not result.ok and list(result.failed) == [bad]
    message = result.failed[bad]
    assert bad in message and f"{mirror.url}/{bad}" in message and "checksum mismatch" in message
    assert "nothing was written" in message and "mirror" in message
    assert not (tmp_path / bad).exists() and not (tmp_path / (bad + ".part")).exists()
    assert sorted(result.downloaded) == sorted(set(mirror.content) - {bad})  # the others are fine

    not_gzip = "multi30k/val.de.gz"
    (tmp_path / not_gzip).unlink()
    mirror.server.files[not_gzip] = b"<html>404 page of some proxy</html>"
    result, _ = mirror.fetch(tmp_path)
    assert not_gzip in result.failed and "not a valid gzip file" in result.failed[not_gzip]
    assert not (tmp_path / not_gzip).exists()


def test_present_file_that_does_not_verify_is_left_alone(mirror, tmp_path):
    assert mirror.fetch(tmp_path)[0].ok
    target = tmp_path / SHAKESPEARE
    target.write_text("edited by hand\n")
    result, _ = mirror.fetch(tmp_path)
    assert list(result.failed) == [SHAKESPEARE]
    assert f"delete {target} and rerun" in result.failed[SHAKESPEARE]
    assert target.read_text() == "edited by hand\n"
    target.unlink()
    assert mirror.fetch(tmp_path)[0].ok


@pytest.mark.parametrize("honour_range", [True, False], ids=["range", "range-ignored"])
def test_truncated_download_resumes(mirror, tmp_path, honour_range):
    mirror.server.honour_range = honour_range
    mirror.server.cut_once.add(SHAKESPEARE)
    stored = mirror.server.files[SHAKESPEARE]
    result, _ = mirror.fetch(tmp_path)
    assert list(result.failed) == [SHAKESPEARE]
    message = result.failed[SHAKESPEARE]
    assert f"{mirror.url}/{SHAKESPEARE}" in message and "rerun" in message and "resume" in message
    part = tmp_path / (SHAKESPEARE + ".part")
    assert not (tmp_path / SHAKESPEARE).exists()
    assert part.stat().st_size == len(stored) // 2 and part.read_bytes() == stored[: len(stored) // 2]

    result, lines = mirror.fetch(tmp_path)
    assert result.ok and result.downloaded == [SHAKESPEARE]
    assert mirror.requests[-1] == (SHAKESPEARE, f"bytes={len(stored) // 2}-")  # the rerun asked for the rest
    resume_lines = [line for line in lines if line.startswith("resume")]
    assert len(resume_lines) == 1
    assert ("continuing from byte" if honour_range else "ignores Range") in resume_lines[0]
    assert (tmp_path / SHAKESPEARE).read_bytes() == stored  # no duplicated prefix when the server restarted
    _assert_laid_out(tmp_path, mirror.content)


def test_truncated_download_retried_in_the_same_run(mirror, tmp_path):
    mirror.server.cut_once.add("fashion-mnist/train-images-idx3-ubyte.gz")
    result, lines = mirror.fetch(tmp_path, retries=1)
    assert result.ok
    assert any(line.startswith("retry") for line in lines) and any(line.startswith("resume") for line in lines)
    _assert_laid_out(tmp_path, mirror.content)


def test_stale_or_complete_part_files(mirror, tmp_path):
    stored = mirror.server.files[SHAKESPEARE]
    part = tmp_path / (SHAKESPEARE + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * 1000)  # a prefix from something else: resumed, fails, downloaded again from zero
    result, lines = mirror.fetch(tmp_path, only=["tinyshakespeare"])
    assert result.ok and any(line.startswith("restart") for line in lines)
    assert (tmp_path / SHAKESPEARE).read_bytes() == stored and not part.exists()

    (tmp_path / SHAKESPEARE).rename(part)  # complete .part (killed before the rename): 416, verified, installed
    result, _ = mirror.fetch(tmp_path, only=["tinyshakespeare"])
    assert result.ok and mirror.requests[-1] == (SHAKESPEARE, f"bytes={len(stored)}-")
    assert (tmp_path / SHAKESPEARE).read_bytes() == stored and not part.exists()


def test_http_error_names_file_url_and_remedy(mirror, tmp_path):
    del mirror.server.files[SHAKESPEARE]
    result, _ = mirror.fetch(tmp_path, retries=2)
    message = result.failed[SHAKESPEARE]
    assert "HTTP 404" in message and f"{mirror.url}/{SHAKESPEARE}" in message and "rerun" in message.lower()
    assert [p for p, _ in mirror.requests].count(SHAKESPEARE) == 1  # a 404 is not retried
    assert not (tmp_path / SHAKESPEARE).exists() and not (tmp_path / (SHAKESPEARE + ".part")).exists()


def test_file_mirror(mirror, tmp_path):
    folder = tmp_path / "mirror"
    for path, data in mirror.server.files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)
    root = tmp_path / "data"
    part = root / (SHAKESPEARE + ".part")
    part.parent.mkdir(parents=True)
    stored = mirror.server.files[SHAKESPEARE]
    part.write_bytes(stored[:1234])  # resumed by seeking
    result, lines = mirror.fetch(root, mirror=folder.as_uri())
    assert result.ok, result.failed
    assert any("continuing from byte 1,234" in line for line in lines)
    _assert_laid_out(root, mirror.content)
    (folder / "multi30k" / "val.de.gz").unlink()
    (root / "multi30k" / "val.de.gz").unlink()
    result, _ = mirror.fetch(root, mirror=str(folder))  # a plain folder is a file:// mirror too
    assert list(result.failed) == ["multi30k/val.de.gz"]
    assert (folder / "multi30k" / "val.de.gz").as_uri() in result.failed["multi30k/val.de.gz"]


def test_upstream_compression_differs_from_the_loaders(mirror, tmp_path):
    """Without a mirror each file comes from its own URL; a plain upstream file for a .gz name is gzipped, and a
    gzip upstream file for a plain name is gunzipped, after verification."""
    text = mirror.content[SHAKESPEARE]
    mirror.server.files["up/plain.txt"] = text
    mirror.server.files["up/packed.txt.gz"] = gzip.compress(text)
    files = [DataFile("tinyshakespeare", "a/input.txt.gz", f"{mirror.url}/up/plain.txt", upstream_gzip=False),
             DataFile("tinyshakespeare", "b/input.txt", f"{mirror.url}/up/packed.txt.gz", upstream_gzip=True)]
    checksum = _checksums({"x": text})["x"]
    result, _ = mirror.fetch(tmp_path, mirror="", files=files, checksums={f.path: checksum for f in files})
    assert result.ok, result.failed
    assert gzip.decompress((tmp_path / "a/input.txt.gz").read_bytes()) == text
    assert (tmp_path / "b/input.txt").read_bytes() == text
    assert not list(tmp_path.rglob("*.part")) and not list(tmp_path.rglob("*.tmp"))


def test_command_line_exit_codes_and_mirror_env(mirror, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fetch_module, "committed_checksums", lambda: mirror.checksums)
    monkeypatch.setenv("TSERVE_DATA_MIRROR", mirror.url)
    monkeypatch.setenv("TSERVE_DATA_DIR", str(tmp_path / "data"))
    assert main(["fetch", "--retries", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{len(FILES)} files verified in {(tmp_path / 'data').resolve()}" in out
    _assert_laid_out(tmp_path / "data", mirror.content)
    assert main(["fetch", "--quiet"]) == 0
    assert capsys.readouterr().out == ""

    (tmp_path / "data" / SHAKESPEARE).unlink()
    del mirror.server.files[SHAKESPEARE]
    assert main(["fetch", "--quiet", "--retries", "0"]) == 1
    err = capsys.readouterr().err
    assert SHAKESPEARE in err and f"{mirror.url}/{SHAKESPEARE}" in err and "1 of 11 files failed" in err

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TSERVE_DATA_DIR")
    assert main(["fetch", "--only", "multi30k", "--mirror", mirror.url, "--quiet"]) == 0  # default ./data
    assert (tmp_path / "data" / "multi30k" / "train.de.gz").is_file()


# --- the committed table -------------------------------------------------------------------------------------------


def test_committed_table_covers_the_layout():
    assert list(CHECKSUMS) == [f.path for f in FILES]
    assert all(len(entry["sha256"]) == 64 and entry["size"] > 0 for entry in CHECKSUMS.values())
    assert all(f.url.startswith("https://raw.githubusercontent.com/") for f in FILES)
    assert {f.dataset for f in FILES} == set(DATASETS)


def test_committed_table_matches_the_reference_copies(full_data_dir):
    """The full data folder (this project's reference copies in ../shared/data, or one `make data` filled; skipped
    without one) has exactly the committed checksums."""
    assert compute_checksums(full_data_dir) == CHECKSUMS
    committed = (PROJECT_ROOT / "models" / "data_checksums.py").read_text()
    assert render_checksums_module(CHECKSUMS) == committed  # exactly what the script writes
