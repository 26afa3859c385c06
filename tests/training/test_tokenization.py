"""Tokenizers: special-token layout, exact round trips, and loading the saved json with plain `tokenizers`."""

from __future__ import annotations

import json
import unicodedata

import pytest
from tokenizers import Tokenizer

from models.data import load_multi30k, load_shakespeare
from models.tokenization import (
    BOS,
    BOS_ID,
    BYTE_VOCAB_SIZE,
    ENDOFTEXT,
    ENDOFTEXT_ID,
    EOS,
    EOS_ID,
    PAD,
    PAD_ID,
    UNK,
    UNK_ID,
    build_byte_tokenizer,
    encode_batch,
    load_tokenizer,
    save_tokenizer,
    train_translation_tokenizer,
)


@pytest.fixture(scope="module")
def pairs(data_dir):
    return load_multi30k(data_dir, "train")[:2000]


@pytest.fixture(scope="module")
def translation_tok(pairs):
    return train_translation_tokenizer((s for pair in pairs for s in pair), vocab_size=1000)


@pytest.fixture(scope="module")
def byte_tok():
    return build_byte_tokenizer()


# --- translation tokenizer -----------------------------------------------------------------------------------------


def test_translation_special_ids(translation_tok):
    assert (PAD, BOS, EOS, UNK) == ("<pad>", "<s>", "</s>", "<unk>")
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    for token, idx in [(PAD, PAD_ID), (BOS, BOS_ID), (EOS, EOS_ID), (UNK, UNK_ID)]:
        assert translation_tok.token_to_id(token) == idx
        assert translation_tok.id_to_token(idx) == token
    assert translation_tok.get_vocab_size() == 1000


def test_translation_no_bos_eos_added(translation_tok):
    ids = translation_tok.encode("Ein Hund läuft.").ids
    assert ids and BOS_ID not in ids and EOS_ID not in ids and PAD_ID not in ids
    assert translation_tok.encode("").ids == []


@pytest.mark.parametrize(
    "text",
    [
        "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
        "Two young, White males are outside near many bushes.",
        'Er sagte: „Hallo!“ und "ja" — 42% (ÄÖÜ ß).',
        "The dog's owner said ‘no’ and “stop”; then: #1 @home [ok] {x} <y> 3.5 + 7 = 10.5?!",
        "Straße, Größe, Übermut: café à la crème, niño.",
        "two  spaces and a trailing space ",
        "UPPER lower MiXeD",
    ],
)
def test_translation_round_trip(translation_tok, text):
    ids = translation_tok.encode(text).ids
    assert UNK_ID not in ids
    assert translation_tok.decode(ids) == text


def test_translation_round_trip_corpus(translation_tok, data_dir):
    val = load_multi30k(data_dir, "val")[:200]  # unseen sentences
    for de, en in val:
        for text in (de, en):
            # the corpus has a few non-breaking spaces, which NFKC turns into plain spaces
            assert translation_tok.decode(translation_tok.encode(text).ids) == unicodedata.normalize("NFKC", text)


def test_translation_known_limits(translation_tok):
    # Documented: NFKC rewrites compatibility characters, a leading space is dropped, unknown chars become <unk>.
    assert translation_tok.decode(translation_tok.encode("a\u00a0b").ids) == "a b"
    assert translation_tok.decode(translation_tok.encode(" lead").ids) == "lead"
    ids = translation_tok.encode("x\u4e2dy").ids
    assert UNK_ID in ids
    assert translation_tok.decode(ids) == "xy"


def test_translation_save_and_from_file(translation_tok, tmp_path, pairs):
    path = save_tokenizer(translation_tok, tmp_path / "sub" / "tokenizer.json")
    assert path.is_file()
    json.loads(path.read_text())  # a single plain json file
    plain = Tokenizer.from_file(str(path))  # what the serving side does, no project code
    ours = load_tokenizer(path)
    texts = [s for pair in pairs[:50] for s in pair] + ['„Zitat“ und "quote".']
    expected = encode_batch(translation_tok, texts)
    assert [plain.encode(t).ids for t in texts] == expected
    assert encode_batch(ours, texts) == expected
    assert [plain.decode(ids) for ids in expected] == texts
    assert plain.token_to_id(UNK) == UNK_ID


def test_load_tokenizer_errors(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_tokenizer(bad)


# --- byte tokenizer --------------------------------------------------------------------------------------------------


def test_byte_layout(byte_tok):
    assert BYTE_VOCAB_SIZE == 257 and ENDOFTEXT_ID == 256
    assert byte_tok.get_vocab_size() == BYTE_VOCAB_SIZE
    assert byte_tok.token_to_id(ENDOFTEXT) == ENDOFTEXT_ID
    assert sorted(byte_tok.get_vocab(with_added_tokens=True).values()) == list(range(BYTE_VOCAB_SIZE))
    # ids are the byte values
    for text in ["A", "\n", " ", "~", "é", "😀"]:
        assert byte_tok.encode(text).ids == list(text.encode("utf-8"))


@pytest.mark.parametrize(
    "text",
    [
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
        "  leading spaces, multiple   spaces and trailing  ",
        "\n\nnewlines\n\n\n",
        "tabs\tand\r\nCRLF",
        "café é É ñ ß",
        "emoji 😀👍🏽 and 中文 and the null byte \x00",
        "",
    ],
)
def test_byte_round_trip(byte_tok, text):
    ids = byte_tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert byte_tok.decode(ids) == text


def test_byte_shakespeare(byte_tok, data_dir):
    train, val = load_shakespeare(data_dir)
    assert train.isascii()
    chunk = train[:100_000]
    ids = byte_tok.encode(chunk).ids
    assert len(ids) == len(chunk)  # ASCII: one token per character
    assert max(ids) < 128
    assert byte_tok.decode(ids) == chunk
    assert byte_tok.decode(byte_tok.encode(val).ids) == val


def test_byte_endoftext(byte_tok):
    ids = byte_tok.encode(f"a{ENDOFTEXT}b").ids
    assert ids == [ord("a"), ENDOFTEXT_ID, ord("b")]
    assert byte_tok.decode(ids) == "ab"  # special tokens are skipped by default
    assert byte_tok.decode(ids, skip_special_tokens=False) == f"a{ENDOFTEXT}b"


def test_byte_save_and_from_file(byte_tok, tmp_path):
    path = save_tokenizer(byte_tok, tmp_path / "tokenizer.json")
    plain = Tokenizer.from_file(str(path))
    text = "To be, or not to be: that is the question.\n  é😀"
    assert plain.encode(text).ids == byte_tok.encode(text).ids == list(text.encode("utf-8"))
    assert plain.decode(plain.encode(text).ids) == text
    assert plain.get_vocab_size() == BYTE_VOCAB_SIZE
