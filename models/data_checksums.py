"""SHA-256 and size of the DECOMPRESSED content of every data file (models/fetch.py verifies downloads
against it). Generated from the reference copies by

    python -m models.fetch checksums /work/shared/data --write

Do not edit by hand: regenerate it from a verified data folder."""

CHECKSUMS: dict[str, dict[str, object]] = {
    "multi30k/train.de.gz":
        {"sha256": "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72", "size": 2110398},
    "multi30k/train.en.gz":
        {"sha256": "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6", "size": 1801238},
    "multi30k/val.de.gz":
        {"sha256": "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660", "size": 75981},
    "multi30k/val.en.gz":
        {"sha256": "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227", "size": 63297},
    "multi30k/test_2016_flickr.de.gz":
        {"sha256": "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16", "size": 70649},
    "multi30k/test_2016_flickr.en.gz":
        {"sha256": "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182", "size": 62076},
    "tinyshakespeare/input.txt":
        {"sha256": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed", "size": 1115394},
    "fashion-mnist/train-images-idx3-ubyte.gz":
        {"sha256": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888", "size": 47040016},
    "fashion-mnist/train-labels-idx1-ubyte.gz":
        {"sha256": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9", "size": 60008},
    "fashion-mnist/t10k-images-idx3-ubyte.gz":
        {"sha256": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b", "size": 7840016},
    "fashion-mnist/t10k-labels-idx1-ubyte.gz":
        {"sha256": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34", "size": 10008},
}
