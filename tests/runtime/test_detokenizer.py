"""The incremental detokenizer against the real SmolLM2 BPE tokenizer: text, stop strings, hold-back."""

from __future__ import annotations

import os
import random

import pytest
from kvfleet_runtime.config import default_model
from kvfleet_runtime.detokenizer import IncrementalDetokenizer
from kvfleet_runtime.sampling_params import SamplingParams
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
SNIPPETS = ["Hello", " world", ", ", "straße", " Grüße", " 日本語のテキスト", " 中文字符",
            " مرحبا", " नमस्ते", " Привет", " 🤖", "👨‍👩‍👧", " 🇫🇷🇩🇪", "👍🏽", "\n", "  ",
            " def f(x):\n    return x", " ½ ≠ ∞", " naïve café", " ẞ", ".", " 1234", "é"]


@pytest.fixture(scope="module")
def tokenizer():
    path = default_model()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feeds ids one at a time; returns every intermediate output_text and the stop string."""
    seen: list[str] = []
    for token_id in ids:
        stop = detok.update([token_id])
        seen.append(detok.output_text)
        if stop is not None:
            return seen, stop
    return seen, None


@pytest.mark.parametrize("seed", range(8))
def test_streamed_text_equals_a_full_decode_and_never_shows_a_broken_char(tokenizer, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(SNIPPETS) for _ in range(40))
    prompt_ids, output_ids = encode(tokenizer, PROMPT), encode(tokenizer, text)
    prompt_text = tokenizer.decode(prompt_ids)
    full = tokenizer.decode(prompt_ids + output_ids)
    assert full.startswith(prompt_text)
    expected = full[len(prompt_text):]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    seen, stop = stream(detok, output_ids)
    assert stop is None
    assert detok.output_text == expected == tokenizer.decode(output_ids)
    assert any(a == b for a, b in zip(seen, seen[1:], strict=False)), "some tokens are partial characters"
    for shown in seen:
        assert "\ufffd" not in shown
        assert expected.startswith(shown)


class SlowTokenizer:
    """The same tokenizer seen as one without a Rust backend (the decode path of slow ones)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self._tokenizer)

    def decode(self, ids: list[int], **kwargs) -> str:
        return self._tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("slow", [False, True])
def test_updates_of_several_tokens_give_the_same_text(tokenizer, slow):
    rng = random.Random(42)
    ids = encode(tokenizer, "".join(rng.choice(SNIPPETS) for _ in range(40)))
    detok = IncrementalDetokenizer(SlowTokenizer(tokenizer) if slow else tokenizer, [],
                                   SamplingParams())
    i = 0
    while i < len(ids):
        size = rng.randint(1, 4)
        detok.update(ids[i:i + size])
        assert "\ufffd" not in detok.output_text
        i += size
    assert detok.output_text == tokenizer.decode(ids)


def test_first_token_keeps_its_leading_space_with_a_sentencepiece_decoder():
    # SentencePiece-style decoders drop the space of a decode's first word: only the
    # prompt's tokens decoded in front of it keep " world" from becoming "world"
    model = Tokenizer(models.WordLevel({"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2},
                                       unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()
    metaspace = PreTrainedTokenizerFast(tokenizer_object=model)
    assert metaspace.decode([2]) == "world"
    detok = IncrementalDetokenizer(metaspace, metaspace.encode("Hello"), SamplingParams())
    detok.update(metaspace.encode(" world"))
    assert detok.output_text == " world" == metaspace.decode([1, 2])[len("Hello"):]


@pytest.mark.parametrize(("skip", "expected"), [(True, "Hi there."), (False, "Hi<|im_end|> there.<|im_end|>")])
def test_skip_special_tokens_is_honoured(tokenizer, skip, expected):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "Hi") + [im_end] + encode(tokenizer, " there.") + [im_end]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    detok.update(ids)
    assert detok.output_text == expected


def test_ids_beyond_the_tokenizer_decode_to_nothing(tokenizer):
    beyond = len(tokenizer) + 7
    detok = IncrementalDetokenizer(tokenizer, [beyond], SamplingParams())
    detok.update(encode(tokenizer, "one") + [beyond] + encode(tokenizer, " two"))
    assert detok.output_text == "one two"
    assert detok.decode_token(beyond) == ""
    assert detok.decode_token(encode(tokenizer, " two")[0]) == " two"


SENTENCE = "The capital of France is Paris. It is lovely."
STOP = "is Par"          # ends inside the token " Paris": it spans " is" and " Paris"


def test_stop_string_spanning_two_tokens_is_caught_and_not_emitted(tokenizer):
    ids = encode(tokenizer, SENTENCE)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert not any(STOP in piece for piece in pieces), "the stop string must span tokens"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[STOP, "lovely"]))
    seen, stop = stream(detok, ids)
    assert stop == STOP
    assert pieces[len(seen) - 1] == " Paris"
    assert detok.output_text == "The capital of France "
    for shown in seen:
        assert detok.output_text.startswith(shown)
    with pytest.raises(RuntimeError, match="after the sequence finished"):
        detok.update(ids[:1])


def test_include_stop_str_in_output_keeps_it_and_cuts_after_it(tokenizer):
    params = SamplingParams(stop=STOP, include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    seen, stop = stream(detok, encode(tokenizer, SENTENCE))
    assert stop == STOP
    assert detok.output_text == "The capital of France is Par"
    assert all(detok.output_text.startswith(shown) for shown in seen)


def test_earliest_of_several_stop_strings_wins_within_one_update(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["lovely", "It"]))
    assert detok.update(encode(tokenizer, SENTENCE)) == "It"
    assert detok.output_text == "The capital of France is Paris. "


def test_held_back_text_is_released_on_finish(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["never said"]))
    ids = encode(tokenizer, SENTENCE)
    seen, stop = stream(detok, ids)
    assert stop is None
    held_back = len("never said") - 1
    for i, shown in enumerate(seen):
        so_far = tokenizer.decode(ids[:i + 1])
        assert shown == so_far[:max(len(so_far) - held_back, 0)]
    detok.finish()
    assert detok.output_text == SENTENCE


def test_fast_stream_shows_what_the_offset_algorithm_shows_on_random_ids(tokenizer):
    # a fast tokenizer streams through tokenizers' DecodeStream, a slow one through the
    # prefix/read offsets; random-weight models emit any ids, byte tokens that never form a
    # character included, and prompts may end inside one: every shown text must agree
    rng = random.Random(3)
    vocab = len(tokenizer)
    for _ in range(200):
        prompt = [rng.randrange(vocab) if rng.random() < 0.5 else rng.randrange(300)
                  for _ in range(rng.randrange(1, 8))]
        ids = [rng.randrange(vocab) if rng.random() < 0.5 else rng.randrange(300)
               for _ in range(rng.randrange(1, 40))]
        fast = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        slow = IncrementalDetokenizer(SlowTokenizer(tokenizer), prompt, SamplingParams())
        for t in ids:
            fast.update([t])
            slow.update([t])
            assert fast.output_text == slow.output_text, (prompt, ids)
