"""vLLM's bad_words: SamplingParams(bad_words=[...]) never lets a word be generated, as it
starts the text or follows a space; a word of several tokens loses its last token wherever the
output so far ends in the others. The reference is HF transformers' generate() with
bad_words_ids (the same ids), in the sync and async engine loops."""

from __future__ import annotations

import pytest
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.sampling_params import bad_words_token_ids
from support.engine_ops import all_blocks_free

# (repeats: n-gram drafts find something to propose)
PROMPTS = [[5, 17, 93, 1200, 44, 5, 17, 93], [7, 3000, 12, 99, 301, 58, 6, 7, 3000, 12]]
N = 12


def _hf(path: str, prompts, bad_ids):
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              do_sample=False, max_new_tokens=N, pad_token_id=0,
                              bad_words_ids=bad_ids, eos_token_id=None)
            out.append(gen[0, len(p):].tolist())
    return out


def _contains(seq: list[int], word: list[int]) -> bool:
    return any(seq[i:i + len(word)] == word for i in range(len(seq) - len(word) + 1))


# the sync loop, the async loop, and n-gram drafts (each draft's row banned as if the drafts
# before it were generated)
@pytest.mark.parametrize("mode", [{"async_scheduling": False}, {"async_scheduling": True},
                                  {"speculative_config": {"method": "ngram",
                                                          "num_speculative_tokens": 3,
                                                          "prompt_lookup_max": 2}}],
                         ids=["sync", "async", "ngram-drafts"])
def test_bad_words_are_never_generated_as_hf_bans_them(tiny_model_dir, mode):
    path = tiny_model_dir("llama")
    llm = LLM(model=path, device="cpu", dtype="float32", num_gpu_blocks=64, **mode)
    tok = llm.engine.tokenizer
    free = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    # one word of one token and one of two, both taken from what the model says unbanned
    one = next(w for t in plain[0][1:] if [t] in bad_words_token_ids(tok, [w := tok.decode([t])]))
    two = next(w for k in range(1, N - 1)
               if plain[1][k:k + 2] in bad_words_token_ids(tok, [w := tok.decode(plain[1][k:k + 2])]))
    words = [one, two]
    bad_ids = bad_words_token_ids(tok, words)
    assert any(len(w) == 1 for w in bad_ids) and any(len(w) > 1 for w in bad_ids), bad_ids
    banned = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, bad_words=words)
    # beside an unbanned request in the same batches
    outs = llm.generate(PROMPTS + PROMPTS[:1], [banned, banned, free])
    got = [o.outputs[0].token_ids for o in outs]
    assert got[2] == plain[0]
    assert got[:2] != plain
    for seq in got[:2]:
        assert not any(_contains(seq, w) for w in bad_ids), (seq, bad_ids)
    assert got[:2] == _hf(path, PROMPTS, bad_ids)
    assert all_blocks_free(llm.engine)


def test_a_drafted_row_bans_the_end_of_a_word_its_drafts_begin():
    # bad word [4, 6]: the row after draft 4 must not keep 6 (the raw argmax); the first row,
    # with no 4 before it, may give 6
    import torch
    from kvfleet_runtime.layers.sampler import verify_drafts
    p = SamplingParams(temperature=0.0)
    p._bad_words_ids = [[4, 6]]
    logits = torch.zeros(2, 8)
    logits[0, 4], logits[1, 6], logits[1, 2] = 5.0, 5.0, 1.0
    (kept,) = verify_drafts(logits, [[4]], [p], [None], [[1, 2]], [[3]])
    assert [t.token_id for t in kept] == [4, 2]
    logits[0, 4], logits[0, 6] = 0.0, 5.0
    (kept,) = verify_drafts(logits, [[4]], [p], [None], [[1, 2]], [[3]])
    assert [t.token_id for t in kept] == [6]


def test_bad_words_tokenize_as_vllm():
    from support.tiny_models import tokenizer_dir
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir())
    ids = bad_words_token_ids(tok, ["hello", " world"])
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert enc("hello") in ids and enc(" hello") in ids      # at the start, after a space
    assert enc("world") in ids and enc(" world") in ids
    with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
        SamplingParams(bad_words=["ok", " "])
