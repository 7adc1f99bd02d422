"""The offline LLM's vLLM-compatible call shapes: TextPrompt / TokensPrompt dicts, and the
use_tqdm progress bar (True: tqdm's; a callable: the tqdm to make it; False: none)."""

from __future__ import annotations

import pytest
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.beam_search import BeamSearchParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=tiny_model_dir("llama3"), num_gpu_blocks=64)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_dicts_are_text_or_token_ids(llm):
    ids = [[5, 17, 300], [9, 8, 7, 6]]
    text = "The quick brown fox"
    plain = _ids(llm.generate(ids + [text], GREEDY, use_tqdm=False))
    dicts = _ids(llm.generate([{"prompt_token_ids": ids[0]}, {"prompt_token_ids": ids[1]},
                               {"prompt": text}], GREEDY, use_tqdm=False))
    assert dicts == plain
    (one,) = llm.generate({"prompt_token_ids": ids[1]}, GREEDY, use_tqdm=False)
    assert one.outputs[0].token_ids == plain[1] and one.prompt_token_ids == ids[1]
    for bad in ({"text": "hi"}, {"prompt": "hi", "prompt_token_ids": [1]},
                {"prompt": "hi", "multi_modal_data": {}}):
        with pytest.raises(ValueError, match="a prompt dict takes 'prompt' .* or "
                                             "'prompt_token_ids'"):
            llm.generate([bad], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


class _Bar:
    made: list[_Bar] = []

    def __init__(self, total, desc, **kwargs):
        self.total, self.desc, self.n, self.postfix, self.closed = total, desc, 0, "", False
        self.format_dict = {"elapsed": 0.5}
        _Bar.made.append(self)

    def update(self, n):
        self.n += n

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def close(self):
        self.closed = True


def test_use_tqdm_counts_the_finished_prompts(llm, capsys):
    _Bar.made.clear()
    llm.generate([[1, 2], [3, 4], [5, 6]], GREEDY, use_tqdm=_Bar)
    (bar,) = _Bar.made
    assert (bar.total, bar.n, bar.desc, bar.closed) == (3, 3, "Processed prompts", True)
    # 3 prompts of 2 tokens and 3 x 4 tokens out in the bar's 0.5 s
    assert bar.postfix == "est. speed input: 12.00 toks/s, output: 24.00 toks/s"
    llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    assert len(_Bar.made) == 1 and "Processed prompts" not in capsys.readouterr().err
    llm.generate([[1, 2]], GREEDY)                  # vLLM's default: tqdm's bar
    assert "Processed prompts: 100%" in capsys.readouterr().err
    llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=_Bar)
    assert _Bar.made[-1].n == 1
    llm.embed(["a", "b"], use_tqdm=_Bar)
    assert _Bar.made[-1].total == 2 and _Bar.made[-1].n == 2


def test_beam_search_bars_its_rounds(llm, capsys):
    _Bar.made.clear()
    llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True),
                    use_tqdm=_Bar)
    (bar,) = _Bar.made          # (its rounds' own generate calls draw none)
    assert (bar.total, bar.n, bar.desc, bar.closed) == (3, 3, "Beam search", True)
    llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert "Processed prompts" not in capsys.readouterr().err
