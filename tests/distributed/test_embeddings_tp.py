"""Embeddings under tensor parallelism (two ranks over gloo): the last token's hidden state on
rank 0 is the whole model's (the final norm runs after the all-reduce), equal to HF
transformers' base model's, for prompts chunked across steps."""

from __future__ import annotations

import random

import pytest
import torch
from kvfleet_runtime import LLM
from support.engine_ops import all_blocks_free


@pytest.mark.timeout(180)
def test_two_ranks_embed_as_hf(tp_model_dir):
    from transformers import AutoModel
    path = tp_model_dir("llama3-gqa")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(2, 60))] for _ in range(5)]
    hf = AutoModel.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = [torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1],
                                              dim=-1) for p in prompts]
    llm = LLM(model=path, tensor_parallel_size=2, dtype="float32", max_num_batched_tokens=32,
              num_gpu_blocks=32)
    try:
        outs = llm.embed(prompts)
        for out, w in zip(outs, want, strict=True):
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), w, rtol=1e-4,
                                       atol=1e-4)
        assert all_blocks_free(llm.engine)
    finally:
        llm.engine.shutdown()


@pytest.mark.timeout(180)
def test_two_ranks_score_a_cross_encoder_as_hf(tp_model_dir):
    # the classifier tokens' logits come from the vocab-parallel lm_head gathered on rank 0
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = tp_model_dir("llama3-gqa")
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    query, docs = "What is the capital of France?", ["Paris, of course. " * 4, "Rome!"]
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    with torch.no_grad():
        want = []
        for d in docs:
            logits = hf(torch.tensor([tok(text=query, text_pair=d).input_ids])).logits[0, -1]
            want.append(torch.sigmoid(logits[yes] - logits[no]).item())
    llm = LLM(model=path, tensor_parallel_size=2, dtype="float32", max_num_batched_tokens=16,
              num_gpu_blocks=32, hf_overrides={"architectures": ["LlamaForSequenceClassification"],
                                               "classifier_from_token": ["no", "yes"]})
    try:
        got = [out.outputs.score for out in llm.score(query, docs)]
        assert got == pytest.approx(want, abs=1e-5)
        assert all_blocks_free(llm.engine)
    finally:
        llm.engine.shutdown()


@pytest.mark.timeout(180)
def test_two_ranks_classify_with_a_sequence_classifier_as_hf(tmp_path):
    # the `score` head is whole on each rank; rank 0 applies it to the whole hidden state
    from support.tiny_models import make_sequence_classifier
    from transformers import AutoModelForSequenceClassification
    path = make_sequence_classifier("qwen3", tmp_path / "seq-cls", 3)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(2, 40))] for _ in range(3)]
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = [torch.softmax(hf(torch.tensor([p])).logits[0], -1) for p in prompts]
    llm = LLM(model=str(path), tensor_parallel_size=2, dtype="float32",
              max_num_batched_tokens=16, num_gpu_blocks=32)
    try:
        for out, w in zip(llm.classify(prompts), want, strict=True):
            assert out.outputs.probs == pytest.approx(w.tolist(), abs=1e-5)
        assert all_blocks_free(llm.engine)
    finally:
        llm.engine.shutdown()
