"""What makes a data file verified: the SHA-256 and size of its *decompressed* content against the committed table
(:mod:`models.data_checksums`), and how that table is computed from a trusted reference folder and written.

Recompressed copies (e.g. Debian's Fashion-MNIST) have other compressed bytes but the same content, so the table
describes content, not files.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

from models.datasets import FILES, DataError, DataFile

CHUNK = 1 << 16  # bytes read (and written) at a time when hashing, copying or (de)compressing a data file
CHECKSUMS_MODULE = Path(__file__).with_name("data_checksums.py")


def committed_checksums() -> Mapping[str, Mapping[str, object]]:
    """The committed table, {path: {"sha256", "size"}}."""
    from models.data_checksums import CHECKSUMS

    return CHECKSUMS


def content_digest(path: str | os.PathLike, gzipped: bool) -> tuple[str, int]:
    """(SHA-256 hex, size) of the file's content, decompressed first when ``gzipped``.

    Raises EOFError for a cut-off gzip stream, OSError (gzip.BadGzipFile) or zlib.error for other damage."""
    digest, size = hashlib.sha256(), 0
    opener = gzip.open if gzipped else open
    with opener(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def compute_checksums(reference_dir: str | os.PathLike, files: Iterable[DataFile] = FILES) -> dict[str, dict]:
    """Checksum table ({path: {"sha256", "size"}} of decompressed content) of a complete reference data folder."""
    root = Path(reference_dir)
    table = {}
    for f in files:
        path = root / f.path
        if not path.is_file():
            raise DataError(f"file not found: {path}; the reference folder must hold every file of the layout")
        try:
            sha256, size = content_digest(path, f.gzip)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"cannot read {path} ({e})") from e
        table[f.path] = {"sha256": sha256, "size": size}
    return table


def render_checksums_module(table: Mapping[str, Mapping[str, object]]) -> str:
    lines = [
        '"""SHA-256 and size of the DECOMPRESSED content of every data file (models/fetch.py verifies downloads',
        "against it). Generated from the reference copies by",
        "",
        "    python -m models.fetch checksums /work/shared/data --write",
        "",
        'Do not edit by hand: regenerate it from a verified data folder."""',
        "",
        "CHECKSUMS: dict[str, dict[str, object]] = {",
    ]
    for path, entry in table.items():
        lines.append(f'    "{path}":\n        {{"sha256": "{entry["sha256"]}", "size": {entry["size"]}}},')
    lines.append("}")
    return "\n".join(lines) + "\n"


def check_content(path: Path, gzipped: bool, expected: Mapping[str, object]) -> tuple[str, str]:
    """("ok" | "short" | "bad", detail). "short": a cut-off gzip stream, or a plain file shorter than expected."""
    try:
        sha256, size = content_digest(path, gzipped)
    except EOFError as e:
        return "short", f"the gzip stream is cut off ({e})"
    except (OSError, zlib.error) as e:
        return "bad", f"not a valid gzip file ({e})" if gzipped else f"cannot be read ({e})"
    if sha256 == expected["sha256"] and size == expected["size"]:
        return "ok", ""
    detail = (f"sha256 of the {'decompressed ' if gzipped else ''}content is {sha256} ({size:,} bytes), "
              f"expected {expected['sha256']} ({int(expected['size']):,} bytes)")
    # A plain file shorter than expected may be cut off; a complete gzip stream is not (a cut one raises EOFError).
    return ("short" if not gzipped and size < int(expected["size"]) else "bad"), detail

