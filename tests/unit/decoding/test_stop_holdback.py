"""What a stream holds back for its stop strings (issue 25, item 11): only the text that can still become a stop
string, i.e. the longest end of the text so far that is the start of a stop string (`StopStrings.held_back`),
never a fixed `max(len(stop)) - 1` characters; the pieces concatenate to the stop-truncated text, never split a
UTF-8 character, and keep the undecided window shorter than the longest stop string; the search's checker sees a
stop string of multi-byte characters (its row's detokeniser releases each character once whole, as `tokenizers`'
DecodeStream does). Then the same through the native and the OpenAI completions streams with a 64-character stop
string: text arrives before the end."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tokenizers.decoders import DecodeStream

from models.tokenization import build_byte_tokenizer
from service.client.sse import parse_sse
from service.decoding import Detokenizer, StopStrings, text_offsets, truncate_at_stop
from service.serving.streaming import IncrementalText
from service.settings import Settings

LONG = "~" * 64  # the protocol's longest stop string (MAX_STOP_CHARS), of a character Shakespeare never writes


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()  # the served GPT's tokenizer: one token per UTF-8 byte


def reference_held_back(text: str, stops: list[str]) -> int:
    """The definition, by brute force over every suffix of the whole text."""
    return max((k for k in range(len(text) + 1)
                if any(k < len(s) and s.startswith(text[len(text) - k :]) for s in stops)), default=0)


# --- StopStrings.held_back ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, stops, held", [
    ("To be, or not to be", ["xyz"], 0),  # no stop string starts here
    ("To be, or not to be", [], 0),  # no stop strings at all
    ("", ["abc"], 0),
    ("a", ["abc"], 1),  # at the text's start
    ("ab", ["abc"], 2),
    ("hello wor", ["world"], 3),
    ("hello wor", ["xyz", "world", "or"], 3),  # the longest candidate among several stops
    ("xxab", ["abc", "bcd"], 2),  # stops that overlap each other
    ("xxabc", ["abcd", "bcde", "cdef"], 3),
    ("aaaa", ["aaab"], 3),  # a stop that overlaps itself
    ("abab", ["abac"], 2),  # "abab" cannot become "abac", its last "ab" can
    ("the end.", [LONG], 0),  # a 64-character stop holds nothing back while its first character is absent
    ("x" * 1000 + "~", [LONG], 1),
    ("x" * 1000 + "~" * 63, [LONG], 63),  # the most that can be held: the longest stop minus one
    ("caf\u00e9 \u00e9", ["\u00e9t\u00e9"], 1),  # characters, not bytes
])
def test_held_back_is_the_longest_end_that_starts_a_stop(text, stops, held):
    assert StopStrings(stops, str).held_back(text) == held == reference_held_back(text, stops)


def test_held_back_matches_the_definition_on_random_texts():
    rng = random.Random(25)
    for _ in range(500):
        stops = ["".join(rng.choice("ab~") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("ab~") for _ in range(rng.randint(0, 30)))
        text, _ = truncate_at_stop(text, stops)  # held_back is asked only of text that holds no whole stop
        assert StopStrings(stops, str).held_back(text) == reference_held_back(text, stops), (text, stops)


# --- StopStrings as the search's checker ------------------------------------------------------------------------

@pytest.mark.parametrize("stop", [
    "ab" * 32,  # 64 bytes
    "\u00e9" * 40,  # 80 bytes in 40 characters: more tokens than characters + 8
    "\U0001f600" * 16,  # 64 bytes in 16 characters (4 tokens each)
    "x\u20ac" * 32,  # 128 bytes in 64 characters
])
def test_the_checker_sees_a_stop_string_of_multi_byte_characters(tokenizer, stop):
    ids = np.array(tokenizer.encode("\u00e9tait " * 20 + stop).ids, dtype=np.int64)
    checker = StopStrings([stop], tokenizer.decode)
    assert not any(checker(ids[:n]) for n in range(1, len(ids)))  # token by token, as the search calls it
    assert checker(ids)  # found when the last byte of its last character arrives
    assert StopStrings([stop], tokenizer.decode)(ids)  # all at once
    assert not StopStrings([stop], tokenizer.decode)(ids[:-1])


# --- Detokenizer: one row's text, token by token ------------------------------------------------------------------

@pytest.mark.parametrize("text", ["ROMEO:\nWhat light", "le caf\u00e9 \u00e9tait", "I \U0001f600 you \U0001f600!",
                                  "x\u20ac" * 20])
def test_the_detokeniser_releases_whole_characters_and_ends_as_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text).ids
    row, stream, pieces = Detokenizer(tokenizer.decode), DecodeStream(skip_special_tokens=True), []
    for token in ids:
        piece = row.add([token])
        assert "\ufffd" not in piece
        assert piece == (stream.step(tokenizer, token) or "")  # tokenizers' own incremental decoding
        pieces.append(piece)
    assert "".join(pieces) == row.text == tokenizer.decode(ids) == text and row.rest() == ""
    cut = Detokenizer(tokenizer.decode)
    cut.add(ids[:-1])  # the last character incomplete when it ends in a multi-byte one
    assert cut.text + cut.rest() == tokenizer.decode(ids[:-1])


def test_text_offsets_count_characters_and_a_completing_token_starts_its_character(tokenizer):
    ids = tokenizer.encode("a\u00e9b").ids  # a, the two bytes of é, b
    assert text_offsets(tokenizer.decode, ids, 10) == [10, 11, 11, 12]


# --- IncrementalText: the stream's pieces ------------------------------------------------------------------------

def stream(tokenizer, text: str, stops: list[str], tokens_per_add: int):
    """Feed `text`'s byte tokens `tokens_per_add` at a time, as a search would (it stops once a stop string is in
    the text); checks every piece against the definition. Returns (pieces, the final text, the rest)."""
    streamed = IncrementalText(tokenizer, stops)
    longest = max((len(s) for s in stops), default=0)
    ids, fed, pieces = tokenizer.encode(text).ids, [], []
    for start in range(0, len(ids), tokens_per_add):
        fed += ids[start : start + tokens_per_add]
        pieces.append(streamed.add(ids[start : start + tokens_per_add]))
        assert "\ufffd" not in pieces[-1]  # never half of a multi-byte character
        so_far = bytes(fed).decode("utf-8", "ignore")  # the whole characters decoded so far
        cut, hit = truncate_at_stop(so_far, stops)
        expected = cut if hit else so_far[: len(so_far) - reference_held_back(so_far, stops)]
        assert "".join(pieces) == expected, (so_far, pieces)
        if hit:
            break
        assert len(streamed.pending) < max(longest, 1)  # the window every add looks at stays bounded
    final, _ = truncate_at_stop(tokenizer.decode(fed), stops)
    rest = streamed.finish(final)
    assert "".join(pieces) + rest == final
    return pieces, final, rest


# --- the detokeniser at its edges: a special token decodes to nothing and leaves nothing held back, the rest of an
# incomplete character is U+FFFD as a full decode writes it, text offsets count from 0 by default -----------------

END_OF_TEXT = 256  # the byte tokenizer's one special token


def test_a_special_token_releases_nothing_and_leaves_no_rest(tokenizer):
    row = Detokenizer(tokenizer.decode)
    assert row.add([END_OF_TEXT]) == ""
    assert row.rest() == ""
    assert row.add(tokenizer.encode("ok").ids) == "ok"
    assert row.rest() == ""


def test_the_rest_of_an_incomplete_character_is_a_replacement_character(tokenizer):
    row = Detokenizer(tokenizer.decode)
    first_byte = tokenizer.encode("\u00e9").ids[:1]  # é is two bytes
    assert row.add(tokenizer.encode("caf").ids + first_byte) == "caf"
    assert row.rest() == "\ufffd"


def test_a_lone_incomplete_first_character_is_held_and_its_rest_is_a_replacement(tokenizer):
    row = Detokenizer(tokenizer.decode)
    assert row.add(tokenizer.encode("\u00e9").ids[:1]) == ""
    assert row.rest() == "\ufffd"


# --- truncate_at_stop and the search's checker ----------------------------------------------------------------

@pytest.mark.parametrize("text, stops, cut", [
    ("abcd", ["a", "c"], ""),          # a stop at index 0 stays the earliest when a later one is found
    ("abcd", ["c", "a"], ""),
    ("xAyA", ["A"], "x"),              # the first occurrence, not the last
    ("hello", ["", "z"], "hello"),     # an empty stop string never matches
])
def test_truncate_at_the_earliest_occurrence(text, stops, cut):
    assert truncate_at_stop(text, stops) == (cut, cut != text)


def test_the_checker_finds_a_stop_at_the_start_split_over_tokens(tokenizer):
    checker = StopStrings(["ab"], tokenizer.decode)
    ids = tokenizer.encode("ab").ids
    assert checker(np.array(ids[:1])) is False
    assert checker(np.array(ids)) is True


def test_a_checker_without_stops_never_stops(tokenizer):
    assert StopStrings([], tokenizer.decode)(np.array(tokenizer.encode("anything").ids)) is False


def test_a_checker_reused_for_a_new_row_starts_again(tokenizer):
    """An array that does not continue the last one (a new, shorter row) is read from its start."""
    checker = StopStrings(["ab"], tokenizer.decode)
    assert checker(np.array(tokenizer.encode("xxab").ids)) is True
    assert checker(np.array(tokenizer.encode("a").ids)) is False
    assert checker(np.array(tokenizer.encode("ab").ids)) is True


def test_text_offsets_count_from_zero_unless_told(tokenizer):
    tokens = tokenizer.encode("ab").ids
    assert text_offsets(tokenizer.decode, tokens) == [0, 1]
    assert text_offsets(tokenizer.decode, tokens, start=10) == [10, 11]


@pytest.mark.parametrize("tokens_per_add", [1, 3, 64])
@pytest.mark.parametrize("text, stops, final, rest", [
    ("ROMEO:\nWhat light", [LONG], "ROMEO:\nWhat light", ""),  # the issue: nothing to hold back
    ("ROMEO:\nWhat light", [], "ROMEO:\nWhat light", ""),
    ("ROMEO:\nWhat light~~~", [LONG], "ROMEO:\nWhat light~~~", "~~~"),
    ("ROMEO:\nWhat light~~~ breaks", [LONG], "ROMEO:\nWhat light~~~ breaks", ""),  # held, then released
    ("ab" * 40, ["ab" * 31 + "x"], "ab" * 40, "ab" * 31),  # a long self-overlapping partial match
    ("\n\nROMEO", ["\n\n"], "", ""),  # a stop string at the text's start
    ("ROMAN", ["ROMEO"], "ROMAN", ""),  # starts like a stop string, then is not one
    ("abababac", ["ababac"], "ab", ""),  # the stop overlaps itself
    ("xabcd", ["bcd", "abcde"], "xa", ""),  # stops overlapping each other
    ("le caf\u00e9 \u00e9tait", ["\u00e9t\u00e9", "\u00e9tait"], "le caf\u00e9 ", ""),  # held over "é"
    ("I \U0001f600 you \U0001f600\U0001f600!", ["\U0001f600\U0001f600"], "I \U0001f600 you ", ""),
    ("I \U0001f600 you \U0001f600", ["\U0001f600\U0001f600"], "I \U0001f600 you \U0001f600", "\U0001f600"),
])
def test_pieces_release_all_but_a_possible_stop(tokenizer, text, stops, final, rest, tokens_per_add):
    _, got_final, got_rest = stream(tokenizer, text, stops, tokens_per_add)
    assert (got_final, got_rest) == (final, rest)


@pytest.mark.parametrize("stops", [["xabcd", "bc"], ["abcd", "bc"]])
def test_earliest_stop_wins_as_in_the_final_text(tokenizer, stops):
    """Token by token "bc" ends first and cuts; when one add completes both, the stop string that starts earlier
    cuts, as `truncate_at_stop` cuts the final text."""
    for tokens_per_add in (1, 5):
        pieces, final, rest = stream(tokenizer, "xabcd", stops, tokens_per_add)
        assert "".join(pieces) == final and rest == ""


def test_a_long_stop_string_does_not_hold_back_every_token(tokenizer):
    pieces, final, _ = stream(tokenizer, "JULIET:\nO Romeo, Romeo", [LONG], 1)
    assert pieces == list(final)  # one character out per token (the issue: 12 empty pieces, then everything)


# --- through the native and the OpenAI completions streams -------------------------------------------------------

PROMPT, MAX_TOKENS = "ROMEO:\n", 40


@pytest.fixture(scope="module")
def client(tiny_repository, serving):
    with serving(Settings(repository=tiny_repository, max_new_tokens=60, max_timeout_ms=60_000)) as client:
        yield client


@pytest.fixture(scope="module")
def plain(client) -> str:
    """The greedy continuation with no stop string."""
    text = client.post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": MAX_TOKENS,
                                              "temperature": 0}).json()["text"]
    assert len(text) >= 20, text
    return text


STOPS = {
    "absent": lambda plain: LONG,
    "starts like the text": lambda plain: plain[5:15] + LONG[10:],  # 64 characters, held while they match
    "in the text": lambda plain: plain[5:15],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STOPS))
def test_native_stream_releases_text_before_the_end(client, plain, case):
    stop = STOPS[case](plain)
    final, hit = truncate_at_stop(plain, [stop])
    held = 0 if hit else reference_held_back(final, [stop])
    body = client.post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": MAX_TOKENS, "temperature": 0,
                                              "stop": [stop], "stream": True}).text
    *pieces, last = parse_sse(body)
    assert last["finish_reason"] == ("stop" if hit else "length")
    assert "".join(p["token"] for p in pieces) == final[: len(final) - held]  # all but the possible stop string
    assert last["token"] == final[len(final) - held :]


def token_bytes(token: str) -> bytes:
    """A completions log-probability token as bytes (`bytes:\\xNN...` for part of a UTF-8 character)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token.removeprefix("bytes:").split("\\x")[1:])
    return token.encode()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STOPS))
def test_completions_stream_releases_text_as_it_becomes_final(client, plain, case):
    """With log-probabilities every chunk names its tokens, so the text sent after each chunk can be checked
    against the definition, however many tokens a wake-up merged; without them no chunk is an empty delta."""
    stop = STOPS[case](plain)
    final, hit = truncate_at_stop(plain, [stop])
    request = {"model": "gpt", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [stop],
               "stream": True}
    choices = [c for event in parse_sse(client.post("/v1/completions", json={**request, "logprobs": 0}).text)
               for c in event["choices"]]
    tokens, sent = b"", ""
    for choice in choices[:-1]:
        tokens += b"".join(token_bytes(t) for t in choice["logprobs"]["tokens"])
        sent += choice["text"]
        so_far = tokens.decode("utf-8", "ignore")  # the whole characters generated so far
        cut, hit_so_far = truncate_at_stop(so_far, [stop])
        assert sent == (cut if hit_so_far else so_far[: len(so_far) - reference_held_back(so_far, [stop])])
    assert choices[-1]["finish_reason"] == ("stop" if hit else "length")
    assert sent + choices[-1]["text"] == final
    if not hit:  # 40 tokens, a wake-up of the event loop per decoding step: not all in the finishing chunk
        assert len(choices) > 1

    choices = [c for event in parse_sse(client.post("/v1/completions", json=request).text)
               for c in event["choices"]]
    assert all(c["text"] and c["finish_reason"] is None for c in choices[:-1])  # held-back tokens send nothing
    assert "".join(c["text"] for c in choices) == final
    assert choices[-1]["finish_reason"] == ("stop" if hit else "length")
