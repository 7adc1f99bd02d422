"""Scoring and classification (kvfleet_runtime/pooling.py; vLLM's `score` and `classify` tasks):
`LLM.score` and `LLM.classify` against HF transformers on tiny random checkpoints. A cross-encoder
made from a causal LM with vLLM's `classifier_from_token` recipe (Qwen3-Reranker's) scores a
(query, document) pair run as one prompt: sigmoid(logit(yes) - logit(no)) at its last position;
a sequence-classification checkpoint classifies and scores by its own `score` head; any other
model scores by the cosine similarity of the two texts' embeddings."""

from __future__ import annotations

import pytest
import torch
from kvfleet_runtime import LLM, PoolingParams, SamplingParams
from kvfleet_runtime.pooling import embedding_sampling_params, score_pairs
from support.engine_ops import all_blocks_free
from support.tiny_models import RERANKER_TEMPLATE, make_sequence_classifier, reranker_text

QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Reranking is fun!",
        "vLLM and kvfleet serve models. " * 6]     # (long: a prefill over several steps)
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}


def hf_pair_logits(path: str, pairs: list[tuple[str, str]], tokens: list[str]) -> list[torch.Tensor]:
    """The causal LM's last-position logits of `tokens` for each pair, joined as the tokenizer
    joins a text pair."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok.convert_tokens_to_ids(tokens)
    with torch.no_grad():
        return [hf(torch.tensor([tok(text=a, text_pair=b).input_ids])).logits[0, -1, ids]
                for a, b in pairs]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, **{"device": "cpu", "dtype": "float32", "num_gpu_blocks": 64,
                              "max_num_batched_tokens": 16, "max_model_len": 256, **kwargs})


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_cross_encoder_scores_as_hf_logits_of_its_tokens(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    arch_name = {"qwen3": "Qwen3", "llama": "Llama"}[arch]
    llm = _llm(path, hf_overrides={**RERANKER,
                                   "architectures": [f"{arch_name}ForSequenceClassification"]})
    assert llm.engine.pooler.cross_encoder
    outs = llm.score(QUERY, DOCS)
    pairs = [(QUERY, d) for d in DOCS]
    want = [torch.sigmoid(no_yes[1] - no_yes[0]).item()
            for no_yes in hf_pair_logits(path, pairs, ["no", "yes"])]
    got = [out.outputs.score for out in outs]
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(got)) == len(got)            # (distinct pairs, distinct scores)
    tok = llm.engine.tokenizer
    assert [out.prompt_token_ids for out in outs] == [tok(text=a, text_pair=b).input_ids
                                                      for a, b in pairs]
    assert all_blocks_free(llm.engine)


def test_a_score_template_formats_each_pair_as_the_model_card_does(tiny_model_dir):
    # vLLM's score template: the roles query and document rendered by a chat template; the
    # pair then scores as the model card's own formatted text, run as one prompt
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = tiny_model_dir("qwen3")
    llm = _llm(path, hf_overrides=RERANKER, max_model_len=512)
    outs = llm.score(QUERY, DOCS[:2], chat_template=RERANKER_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    for out, doc in zip(outs, DOCS[:2], strict=True):
        ids = tok(reranker_text(QUERY, doc), add_special_tokens=False).input_ids
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            x = hf(torch.tensor([ids])).logits[0, -1]
        assert out.outputs.score == pytest.approx(torch.sigmoid(x[yes] - x[no]).item(), abs=1e-5)


def test_one_classifier_token_scores_its_sigmoid(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    llm = _llm(path, hf_overrides={**RERANKER, "classifier_from_token": ["yes"]})
    (got,) = llm.score(QUERY, DOCS[0])
    (logit,) = hf_pair_logits(path, [(QUERY, DOCS[0])], ["yes"])
    assert got.outputs.score == pytest.approx(torch.sigmoid(logit[0]).item(), abs=1e-5)


def test_other_models_score_by_cosine_of_embeddings(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    llm = _llm(path)
    assert not llm.engine.pooler.cross_encoder
    embedded = {t: torch.tensor(e.outputs.embedding) for t, e in
                zip([QUERY, *DOCS], llm.embed([QUERY, *DOCS]), strict=True)}
    outs = llm.score([QUERY, DOCS[1]], [DOCS[0], DOCS[2]])      # pair by pair
    want = [torch.nn.functional.cosine_similarity(embedded[a], embedded[b], dim=0).item()
            for a, b in [(QUERY, DOCS[0]), (DOCS[1], DOCS[2])]]
    assert [o.outputs.score for o in outs] == pytest.approx(want, abs=1e-5)
    assert all_blocks_free(llm.engine)


def test_pairing_follows_vllm():
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], "a") == [("q", "a")]
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    with pytest.raises(ValueError, match="text_1 must hold one text or as many as text_2"):
        score_pairs(["q", "r"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="text_2 must not be empty"):
        score_pairs("q", [])


@pytest.mark.parametrize("tokens, message", [
    (["no", "zzzqqq"], r"\['zzzqqq'\] not tokens of this model's vocabulary"),
    (["a", "b", "c"], "must list one or two tokens"),
    ("yes", "must list one or two tokens"),
])
def test_a_bad_classifier_from_token_is_refused_by_name(tiny_model_dir, tokens, message):
    llm = _llm(tiny_model_dir("qwen3"),
               hf_overrides={**RERANKER, "classifier_from_token": tokens})
    with pytest.raises(ValueError, match=message):
        llm.score(QUERY, DOCS[0])
    assert all_blocks_free(llm.engine)


def test_a_score_request_on_an_embedding_model_says_it_scores_by_cosine(tiny_model_dir):
    llm = _llm(tiny_model_dir("qwen3"))
    with pytest.raises(ValueError, match="scores by the cosine similarity"):
        llm.generate([QUERY], embedding_sampling_params(PoolingParams(task="score")))
    with pytest.raises(ValueError, match="task must be one of embed, score, classify"):
        PoolingParams(task="reward")


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """Tiny sequence-classification checkpoints (HF's own): Qwen3 of three labels, Qwen2 (tied
    embeddings) of one."""
    root = tmp_path_factory.mktemp("seq-cls")
    return {n: str(make_sequence_classifier(arch, root / str(n), n))
            for n, arch in ((3, "qwen3"), (1, "qwen2"))}


def hf_classifier_logits(path: str, prompts: list) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [hf(torch.tensor([p if isinstance(p, list) else tok(p).input_ids])).logits[0]
                for p in prompts]


def test_a_sequence_classifier_classifies_as_hf(classifier_dir):
    path = classifier_dir[3]
    llm = _llm(path)
    assert llm.engine.pooler.labels == ("negative", "neutral", "positive")
    prompts = [QUERY, *DOCS]
    outs = llm.classify(prompts)
    for out, logits in zip(outs, hf_classifier_logits(path, prompts), strict=True):
        assert out.outputs.num_classes == 3
        assert out.outputs.probs == pytest.approx(torch.softmax(logits, -1).tolist(), abs=1e-5)
    # no lm_head: it does not generate, and a score needs one or two labels
    with pytest.raises(ValueError, match="not generation"):
        llm.generate(QUERY, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="this classifier has 3 labels: classify instead"):
        llm.score(QUERY, DOCS[0])
    assert all_blocks_free(llm.engine)


def test_a_one_label_sequence_classifier_scores_pairs_as_hf(classifier_dir):
    path = classifier_dir[1]
    llm = _llm(path)
    assert llm.engine.pooler.cross_encoder
    tok = llm.engine.tokenizer
    pairs = [(QUERY, d) for d in DOCS]
    want = [torch.sigmoid(x[0]).item() for x in
            hf_classifier_logits(path, [tok(text=a, text_pair=b).input_ids for a, b in pairs])]
    assert [o.outputs.score for o in llm.score(QUERY, DOCS)] == pytest.approx(want, abs=1e-5)
    (one,) = llm.classify(QUERY)
    assert one.outputs.num_classes == 1


def test_classify_needs_a_classifier(tiny_model_dir):
    llm = _llm(tiny_model_dir("qwen3"))
    with pytest.raises(ValueError, match="task 'classify' needs a classifier"):
        llm.classify(QUERY)
    # a classifier_from_token model classifies over its tokens
    llm = _llm(tiny_model_dir("qwen3"), hf_overrides=RERANKER)
    (out,) = llm.classify(QUERY)
    (score,) = llm.score(QUERY, "")         # (the same prompt: the pair's second text empty)
    assert out.outputs.num_classes == 2 and sum(out.outputs.probs) == pytest.approx(1.0)
    assert score.outputs.score == pytest.approx(out.outputs.probs[1], abs=1e-6)


def test_runner_pooling_refuses_generation_and_generate_refuses_pooling(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    llm = _llm(path, runner="pooling")
    with pytest.raises(ValueError, match="runner 'pooling'"):
        llm.generate(QUERY, SamplingParams(max_tokens=2))
    assert len(llm.embed(QUERY)[0].outputs.embedding) == 64
    llm = _llm(path, runner="generate")
    with pytest.raises(ValueError, match="runner 'generate'"):
        llm.embed(QUERY)
    assert llm.generate(QUERY, SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
    assert all_blocks_free(llm.engine)
    with pytest.raises(ValueError, match="runner must be one of auto, generate, pooling"):
        _llm(path, runner="embed")
    # vLLM's older spelling, as model cards write it: LLM(..., task="score")
    assert _llm(path, task="score").engine.config.runner == "pooling"
    with pytest.raises(ValueError, match="task must be one of"):
        _llm(path, task="rerank")


@pytest.mark.gpu
def test_scores_and_classes_on_the_gpu_in_bf16(tiny_model_dir, classifier_dir):
    # the classifier tokens' logits and the score head in bf16 on CUDA (graphs on for the
    # decode steps beside them), within bf16's reach of HF's fp32
    path = tiny_model_dir("qwen3")
    llm = LLM(model=path, device="cuda", dtype="bfloat16", num_gpu_blocks=64,
              max_model_len=256, hf_overrides=RERANKER)
    want = [torch.sigmoid(x[1] - x[0]).item()
            for x in hf_pair_logits(path, [(QUERY, d) for d in DOCS], ["no", "yes"])]
    assert [o.outputs.score for o in llm.score(QUERY, DOCS)] == pytest.approx(want, abs=3e-2)
    assert all_blocks_free(llm.engine)
    path = classifier_dir[3]
    llm = LLM(model=path, device="cuda", dtype="bfloat16", num_gpu_blocks=64, max_model_len=256)
    for out, logits in zip(llm.classify(DOCS), hf_classifier_logits(path, DOCS), strict=True):
        assert out.outputs.probs == pytest.approx(torch.softmax(logits, -1).tolist(), abs=3e-2)
