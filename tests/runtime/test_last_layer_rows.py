"""An eager step runs its last layer past attention on the rows whose logits it wants only
(ModelRunner._forward, DecoderModel's `rows`): a prefill step's other tokens need only their
K/V, which that layer writes before its attention. The hidden states and tokens must be those
of the full forward (adapters included), and the skipped rows must really be skipped."""

from __future__ import annotations

import pytest
import torch
from kvfleet_runtime import LLM, LoRARequest, SamplingParams
from support.lora import make_lora_adapter


def _rows_into(module: torch.nn.Module, seen: list[int]):
    return module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))


@pytest.mark.parametrize("arch,backend", [("llama3", "torch"), ("qwen3", "triton"),
                                          ("qwen3_moe", "torch"), ("phi3", "torch")])
def test_the_wanted_rows_of_the_full_forward(tiny_model_dir, arch, backend):
    llm = LLM(model=tiny_model_dir(arch), dtype="float32", max_num_seqs=8, max_model_len=256,
              max_num_batched_tokens=64, attention_backend=backend)
    runner = llm.engine.runner
    model = runner.model.model
    first, last = [], []
    hooks = [_rows_into(model.layers[0].self_attn.o_proj, first),
             _rows_into(model.layers[-1].self_attn.o_proj, last),
             _rows_into(model.layers[-1].mlp, last)]
    torch.manual_seed(0)
    runner.kv_cache.normal_()      # the decode rows' contexts: block 0, the same for both
    with torch.inference_mode():
        ids, positions, meta = runner._synthetic_step(3, 40, 17)     # 3 decode rows + 17
        ids.random_(0, runner.model_config.vocab_size)
        # written into block 5 on (the torch path takes no slot -1), which no row reads
        meta.slot_mapping = torch.arange(20) + 5 * runner.block_size
        full = runner.model(ids, positions, meta)
        wanted = torch.tensor([0, 2, 19])      # two decode rows and the prompt chunk's last
        part = runner.model(ids, positions, meta, wanted)
    for h in hooks:
        h.remove()
    assert full.shape[0] == 20 and part.shape[0] == 3
    torch.testing.assert_close(part, full[wanted], rtol=1e-5, atol=1e-5)
    # every layer but the last ran all 20 rows both times; the last layer ran 3 the second time
    assert first == [20, 20] and last == [20, 20, 3, 3]


def test_engine_tokens_and_prompt_logprobs_as_on_every_row(tiny_model_dir, monkeypatch):
    prompts = [[(7 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate((5, 40, 23, 61))]
    alone = [(5 * j) % 97 + 2 for j in range(70)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    logprobs = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)

    def run(switch: str):
        monkeypatch.setenv("KVFLEET_LAST_LAYER_ROWS", switch)
        # 32-token chunks: prompts cut over steps, mixed with decode rows
        llm = LLM(model=tiny_model_dir("llama3"), dtype="float32", max_num_seqs=4,
                  max_model_len=256, max_num_batched_tokens=32)
        runner = llm.engine.runner
        assert runner.last_layer_rows == (switch != "0")
        seen, wanted = [], []
        hook = _rows_into(runner.model.model.layers[-1].self_attn.o_proj, seen)
        forward = runner._forward

        def spy(step, keep_hidden=False):
            wanted.append((step.input_ids.shape[0], len(step.logits_rows)))
            return forward(step, keep_hidden)
        monkeypatch.setattr(runner, "_forward", spy)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        # alone, a 70-token prompt's first chunk ends no prompt: a step that wants no row
        tokens += [o.outputs[0].token_ids for o in llm.generate([alone], greedy)]
        lp = llm.generate(prompts[1:3], logprobs)
        hook.remove()
        prompt_lp = [[{t: round(x.logprob, 4) for t, x in (d or {}).items()} for d in o.prompt_logprobs]
                     for o in lp]
        return tokens, prompt_lp, seen, wanted

    tokens, prompt_lp, seen, wanted = run("")
    assert (tokens, prompt_lp) == run("0")[:2]
    # the last layer ran each step's wanted rows (one for a step that wants none), where
    # the step had other rows
    assert seen == [rows if rows == t else max(1, rows) for t, rows in wanted]
    assert any(rows < t for t, rows in wanted)        # some steps did skip rows
    assert any(rows == 0 for _, rows in wanted)      # a chunk that ends no prompt, alone


def test_adapters_keep_their_rows_slots(tiny_model_dir, tmp_path, monkeypatch):
    # each kept row's adapter is its own (StepMasks.select): a batch mixing two adapters and
    # the base model gives the tokens it gives on every row, in one prefill step
    path = tiny_model_dir("llama3")
    a = str(make_lora_adapter(path, tmp_path / "a", rank=8, seed=1))
    b = str(make_lora_adapter(path, tmp_path / "b", rank=4, seed=2, targets=("o_proj", "down_proj")))
    prompts = [[(11 * i + 3 * j) % 80 + 5 for j in range(9 + i)] for i in range(6)]
    order = [LoRARequest("a", 1, a), None, LoRARequest("b", 2, b)] * 2
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(switch: str):
        monkeypatch.setenv("KVFLEET_LAST_LAYER_ROWS", switch)
        llm = LLM(model=path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
        assert llm.engine.runner.last_layer_rows == (switch != "0")
        seen = []
        hook = _rows_into(llm.engine.runner.model.model.layers[-1].mlp.down_proj, seen)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                               lora_request=order)]
        hook.remove()
        return tokens, seen[0]

    (tokens, first), (every, first_every) = run(""), run("0")
    assert tokens == every
    assert first == 6 and first_every == sum(map(len, prompts))     # the prefill step
    # the adapters move the outputs (a wrong slot for a kept row would show)
    base = [o.outputs[0].token_ids for o in LLM(model=path, dtype="float32").generate(prompts, params)]
    assert tokens[0] != base[0] and tokens[2] != base[2] and tokens[1] == base[1]


def test_the_switch_is_checked(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("KVFLEET_LAST_LAYER_ROWS", "no")
    with pytest.raises(ValueError, match="KVFLEET_LAST_LAYER_ROWS must be unset, 0 or 1"):
        LLM(model=tiny_model_dir("llama3"), dtype="float32")
