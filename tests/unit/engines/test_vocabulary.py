"""A text version's tokenizer checked against its graphs when its engine is built (`service.engines.vocabulary`),
table-style over real tokenizers (the GPT's byte-level one, a translation BPE) and graphs described by their logits'
shape: a tokenizer of another model (issue 51 item 6: translation/4 with gpt/4's tokenizer.json loaded READY and
translated into bytes) is refused naming the mismatch, the released pairings pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from models.tokenization import BYTE_VOCAB_SIZE, ENDOFTEXT_ID, build_byte_tokenizer, train_translation_tokenizer
from service.engines.vocabulary import VocabularyMismatch, check_vocabulary, graphs_of, logits_width

TRANSLATION_VOCAB = 400  # the translation graphs' width here: more ids than the BPE trained below holds
TRANSLATION_SPECIALS = {"pad_id": 0, "bos_id": 1, "eos_id": 2}
GPT_SPECIALS = {"eos_id": ENDOFTEXT_ID}
SENTENCES = ["Ein Mann fährt Fahrrad.", "A man rides a bike.", "Zwei Hunde spielen im Schnee."] * 4


def graph(width) -> SimpleNamespace:
    """A session whose logits are (batch, sequence, width), as the exported decoders' are."""
    return SimpleNamespace(get_outputs=lambda: [SimpleNamespace(name="present.0.key", shape=["batch", 4, "t", 8]),
                                                SimpleNamespace(name="logits", shape=["batch", "sequence", width])])


@pytest.fixture(scope="module")
def tokenizers():
    bpe = train_translation_tokenizer(SENTENCES, TRANSLATION_VOCAB)
    assert bpe.get_vocab_size() <= TRANSLATION_VOCAB
    return {"bytes": build_byte_tokenizer(), "bpe": bpe}


# (tokenizer, config vocab_size, {graph file: logits width}, special ids, what the refusal names; None: accepted)
CASES = {
    "the GPT as released": ("bytes", BYTE_VOCAB_SIZE, {"decoder.onnx": BYTE_VOCAB_SIZE,
                                                       "decoder_step.onnx": BYTE_VOCAB_SIZE}, GPT_SPECIALS, None),
    "the translator as released": ("bpe", TRANSLATION_VOCAB, {"decoder.onnx": TRANSLATION_VOCAB},
                                   TRANSLATION_SPECIALS, None),
    "a width the graph leaves symbolic": ("bytes", BYTE_VOCAB_SIZE, {"decoder.onnx": "vocab"}, GPT_SPECIALS, None),
    "the translator with the GPT's tokenizer": ("bytes", TRANSLATION_VOCAB, {"decoder.onnx": TRANSLATION_VOCAB},
                                                TRANSLATION_SPECIALS, "special_tokens.pad_id is 0"),
    "the GPT with a larger tokenizer": ("bytes", 100, {"decoder.onnx": 100}, {"eos_id": 2},
                                       f"tokenizer.json has {BYTE_VOCAB_SIZE} ids but the model's graphs score 100"),
    "the GPT with the translator's tokenizer": ("bpe", BYTE_VOCAB_SIZE, {"decoder.onnx": BYTE_VOCAB_SIZE},
                                                GPT_SPECIALS, f"special_tokens.eos_id is {ENDOFTEXT_ID}"),
    "a special id past the tokenizer": ("bytes", BYTE_VOCAB_SIZE, {"decoder.onnx": BYTE_VOCAB_SIZE},
                                        {"eos_id": 9999}, "that id does not exist"),
    "a config that disagrees with its graph": ("bytes", BYTE_VOCAB_SIZE, {"decoder.onnx": BYTE_VOCAB_SIZE,
                                                                          "decoder_step.onnx": 300},
                                               GPT_SPECIALS, "decoder_step.onnx scores 300 tokens"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tokenizer_is_checked_against_the_graphs(tokenizers, case):
    tokenizer, vocab_size, widths, specials, refusal = CASES[case]
    graphs = {name: graph(width) for name, width in widths.items()}
    if refusal is None:
        check_vocabulary(tokenizers[tokenizer], vocab_size, graphs, specials)
        return
    with pytest.raises(VocabularyMismatch) as refused:
        check_vocabulary(tokenizers[tokenizer], vocab_size, graphs, specials)
    assert refusal in str(refused.value), str(refused.value)


def test_the_graphs_an_engine_runs_are_named_by_their_files():
    decoder, step = graph(8), graph(8)
    files = {"encoder": "encoder.onnx", "decoder": "decoder.onnx", "decoder_step": "decoder_step.onnx"}
    assert graphs_of(files, decoder, SimpleNamespace(session=step)) == {"decoder.onnx": decoder,
                                                                        "decoder_step.onnx": step}
    assert graphs_of({"decoder_step": "decoder_step.onnx"}, None, SimpleNamespace(session=step)) == {
        "decoder_step.onnx": step}
    assert graphs_of(files, decoder, None) == {"decoder.onnx": decoder}
    assert logits_width(graph(8)) == 8 and logits_width(graph("vocab")) is None
