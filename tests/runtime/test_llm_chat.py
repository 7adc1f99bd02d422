"""The offline LLM.chat: the chat template given, tools and template kwargs reach it (vLLM's
LLM.chat arguments), and one or several conversations come back in order."""

from __future__ import annotations

import pytest
from kvfleet_runtime.llm import LLM
from kvfleet_runtime.sampling_params import SamplingParams

TEMPLATE = ("{% if tools %}[tools:{% for t in tools %} {{ t.function.name }}{% endfor %}]"
            "{% endif %}{% if mood %}[mood: {{ mood }}]{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=tiny_model_dir("llama"), max_num_seqs=4, num_gpu_blocks=64,
               max_model_len=256, device="cpu")


def test_chat_renders_the_template_with_tools_and_kwargs(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (out,) = llm.chat([{"role": "user", "content": "Hi"}], params, chat_template=TEMPLATE,
                      tools=[TOOL], chat_template_kwargs={"mood": "sunny"})
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert prompt == "[tools: get_weather][mood: sunny]<user>Hi<assistant>"
    assert len(out.outputs[0].token_ids) == 3
    plain, again = llm.chat([[{"role": "user", "content": "Hi"}],
                             [{"role": "user", "content": "Yo"}]], params,
                            chat_template=TEMPLATE)
    assert llm.get_tokenizer().decode(plain.prompt_token_ids) == "<user>Hi<assistant>"
    assert llm.get_tokenizer().decode(again.prompt_token_ids) == "<user>Yo<assistant>"
