"""Write the README's example images: Fashion-MNIST test images as PNG files named after their labels.

    python -m models.example_images [--out DIR] [--index N ...] [--data-dir DIR]

By default test images 0 and 1, `ankle_boot.png` and `pullover.png`, into the current folder: the files the README's
`/v1/classify`, Open Inference Protocol and tritonclient examples send. The images come from the data folder when it
holds Fashion-MNIST (`make data`; $TSERVE_DATA_DIR, else ../shared/data, else ./data), else from the committed test
fixtures (tests/fixtures/data, the test set's first 500 images: the same pixels), so a fresh clone needs no
download. PNG is lossless, so the server classifies exactly the test set's pixels. Needs numpy and Pillow only (the
serving install has both).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from models.data import FASHION_MNIST_LABELS, load_fashion_mnist, resolve_data_dir
from models.datasets import FASHION_MNIST_SPLITS, DataError

README_INDEXES = (0, 1)  # the README's examples: test image 0 is an ankle boot, 1 a pullover
FIXTURE_DATA = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "data"


def default_data_dir() -> Path:
    """The data folder if it holds the Fashion-MNIST test set, else the committed fixtures."""
    try:
        folder = resolve_data_dir()
    except DataError:
        return FIXTURE_DATA
    prefix = FASHION_MNIST_SPLITS["test"]
    has_test_set = all((folder / "fashion-mnist" / f"{prefix}-{kind}-ubyte.gz").is_file()
                       for kind in ("images-idx3", "labels-idx1"))
    return folder if has_test_set else FIXTURE_DATA


def file_name(label: str) -> str:
    """`Ankle boot` -> `ankle_boot.png`, `T-shirt/top` -> `t_shirt_top.png`."""
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_") + ".png"


def write_examples(out: Path, indexes: tuple[int, ...] = README_INDEXES, data_dir: str | Path | None = None
                   ) -> list[Path]:
    """Test images `indexes` as PNG files in `out`, each named after its label (with its index too when two
    images share a label); returns the paths written."""
    from PIL import Image

    images, labels = load_fashion_mnist(data_dir if data_dir is not None else default_data_dir(), "test")
    outside = [i for i in indexes if not 0 <= i < len(images)]
    if outside:
        raise ValueError(f"test image index {outside[0]} is outside 0..{len(images) - 1} (this data folder's test set)")
    names = [file_name(FASHION_MNIST_LABELS[labels[i]]) for i in indexes]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, name in zip(indexes, names):
        if names.count(name) > 1:
            name = name.replace(".png", f"_{index}.png")
        path = out / name
        Image.fromarray(images[index]).save(path, format="PNG")  # (28, 28) uint8: mode "L"
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.example_images", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder to write into (default: this one)")
    parser.add_argument("--index", type=int, nargs="+", default=list(README_INDEXES),
                        help="test set indexes (default: 0 1, the README's ankle boot and pullover)")
    parser.add_argument("--data-dir", default=None,
                        help="data folder (default: the data folder if it has Fashion-MNIST, else tests/fixtures/data)")
    args = parser.parse_args(argv)
    try:
        paths = write_examples(args.out, tuple(args.index), args.data_dir)
    except (DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(path) for path in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
