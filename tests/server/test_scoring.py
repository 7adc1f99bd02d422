"""vLLM's scoring endpoints: `/score` (`/v1/score`), `/rerank` (`/v1/rerank`, `/v2/rerank`) and
`/classify`, in both engine modes, against HF transformers on the same tiny random checkpoint: a
cross-encoder made with vLLM's `classifier_from_token` recipe (Qwen3-Reranker's `--hf-overrides`)
scores sigmoid(logit(yes) - logit(no)) of each (query, document) pair run as one prompt; a model
without it scores by the cosine similarity of the two texts' embeddings; a sequence-classification
checkpoint classifies by its own head."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from support.server import running_server
from support.tiny_models import (
    RERANKER_TEMPLATE,
    make_sequence_classifier,
    make_tiny_model,
    reranker_text,
)

QUERY = "What is the capital of France?"
DOCS = ["Reranking is fun!", "The capital of France is Paris.", "Paris " * 30]
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("rerank"), initializer_range=0.2)


@pytest.fixture(scope="module")
def hf(model: Path):
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    base = AutoModel.from_pretrained(model, dtype=torch.float32)
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])

    def rerank(a: str, b: str) -> float:
        with torch.no_grad():
            logits = lm(torch.tensor([tok(text=a, text_pair=b).input_ids])).logits[0, -1]
        return torch.sigmoid(logits[yes] - logits[no]).item()

    def cos(a: str, b: str) -> float:
        with torch.no_grad():
            ha, hb = (base(torch.tensor([tok(t).input_ids])).last_hidden_state[0, -1]
                      for t in (a, b))
        return torch.nn.functional.cosine_similarity(ha, hb, dim=0).item()
    return tok, rerank, cos


@pytest.fixture(scope="module", params=["thread", "engine-process"])
def reranker(model: Path, request):
    # as vLLM's recipe spells it: --runner pooling, --hf_overrides with an underscore
    flags = ["--engine-process"] if request.param == "engine-process" else ["--no-engine-process"]
    with running_server(model, "--max-model-len", "128", "--dtype", "float32",
                        "--served-model-name", "reranker", "--runner", "pooling",
                        "--hf_overrides", json.dumps(RERANKER), *flags) as s:
        yield s


@pytest.fixture(scope="module")
def embedder(model: Path):
    with running_server(model, "--max-model-len", "128", "--dtype", "float32",
                        "--served-model-name", "embedder") as s:
        yield s


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_a_cross_encoder_scores_each_pair_as_hf(reranker, hf, path):
    tok, rerank, _ = hf
    r = _post(reranker, path, {"model": "reranker", "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert body["model"] == "reranker"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert {d["object"] for d in body["data"]} == {"score"}
    got = [d["score"] for d in body["data"]]
    assert got == pytest.approx([rerank(QUERY, d) for d in DOCS], abs=1e-4)
    tokens = sum(len(tok(text=QUERY, text_pair=d).input_ids) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                             "completion_tokens": 0}


def test_two_lists_score_pair_by_pair(reranker, hf):
    _, rerank, _ = hf
    r = _post(reranker, "/score", {"text_1": [QUERY, DOCS[0]], "text_2": DOCS[1:]})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(
        [rerank(QUERY, DOCS[1]), rerank(DOCS[0], DOCS[2])], abs=1e-4)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_answers_documents_best_first(reranker, hf, path):
    _, rerank, _ = hf
    want = [rerank(QUERY, d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    r = _post(reranker, path, {"model": "reranker", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("rerank-") and body["model"] == "reranker"
    assert [x["index"] for x in body["results"]] == order
    assert [x["relevance_score"] for x in body["results"]] == pytest.approx(
        [want[i] for i in order], abs=1e-4)
    assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in order]
    assert body["usage"]["total_tokens"] > 0


def test_rerank_top_n_documents_as_objects_and_no_documents_back(reranker, hf):
    _, rerank, _ = hf
    best = max(range(len(DOCS)), key=lambda i: rerank(QUERY, DOCS[i]))
    r = _post(reranker, "/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                    "top_n": 1, "return_documents": False})
    assert r.status_code == 200, r.text
    (result,) = r.json()["results"]
    assert result["index"] == best and "document" not in result


def test_use_activation_false_gives_the_raw_logit(reranker, hf):
    # vLLM's use_activation: the raw logit(yes) - logit(no), whose sigmoid is the score
    _, rerank, _ = hf
    r = _post(reranker, "/score", {"text_1": QUERY, "text_2": DOCS, "use_activation": False})
    assert r.status_code == 200, r.text
    raw = torch.tensor([d["score"] for d in r.json()["data"]])
    assert torch.sigmoid(raw).tolist() == pytest.approx([rerank(QUERY, d) for d in DOCS],
                                                        abs=1e-4)
    assert (raw < 0).any() or (raw > 1).any()        # (not probabilities)


def test_rerank_max_tokens_per_doc_scores_each_document_on_its_first_tokens(reranker, hf):
    tok, rerank, _ = hf
    cut = [tok.decode(tok(d, add_special_tokens=False).input_ids[:4]) for d in DOCS]
    r = _post(reranker, "/v2/rerank", {"query": QUERY, "documents": DOCS,
                                       "max_tokens_per_doc": 4})
    assert r.status_code == 200, r.text
    results = {x["index"]: x for x in r.json()["results"]}
    assert [results[i]["relevance_score"] for i in range(3)] == pytest.approx(
        [rerank(QUERY, c) for c in cut], abs=1e-4)
    assert [results[i]["document"]["text"] for i in range(3)] == DOCS    # (whole, as given)


def test_other_models_score_by_cosine_of_embeddings(embedder, hf):
    _, _, cos = hf
    want = [cos(QUERY, d) for d in DOCS]
    r = _post(embedder, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-4)
    r = _post(embedder, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert [x["index"] for x in r.json()["results"]] == sorted(
        range(len(DOCS)), key=lambda i: -want[i])[:2]


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, 400, "text_1"),
    ("/score", {"text_1": QUERY, "text_2": []}, 400, "text_2"),
    ("/score", {"text_1": QUERY, "text_2": "word " * 200}, 400, "text_2"),
    ("/score", {"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("/score", {"text_1": QUERY, "text_2": DOCS, "model": "nope"}, 404, "model"),
    ("/rerank", {"query": QUERY, "documents": []}, 400, "documents"),
    ("/rerank", {"query": QUERY, "documents": ["word " * 200]}, 400, "documents"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, 400, "top_n"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 0}, 400,
     "max_tokens_per_doc"),
    ("/rerank", {"documents": DOCS}, 400, "query"),
])
def test_bad_requests_name_their_field(reranker, path, body, status, param):
    r = _post(reranker, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert reranker.idle()


def test_a_long_pair_truncated_keeps_its_last_tokens(reranker, hf):
    tok, _, _ = hf
    long = "word " * 200
    r = _post(reranker, "/score", {"text_1": QUERY, "text_2": long,
                                   "truncate_prompt_tokens": 50})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 50


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = make_sequence_classifier("qwen3", tmp_path_factory.mktemp("seq-cls"), 3)
    with running_server(path, "--max-model-len", "128", "--dtype", "float32",
                        "--served-model-name", "sentiment") as s:
        yield s, path


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_a_sequence_classifier_classifies_as_hf(classifier, path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    server, model = classifier
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32)
    texts = [QUERY, *DOCS]
    with torch.no_grad():
        want = [torch.softmax(hf(torch.tensor([tok(t).input_ids])).logits[0], -1) for t in texts]
    r = _post(server, path, {"model": "sentiment", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    names = ["negative", "neutral", "positive"]
    for item, w in zip(body["data"], want, strict=True):
        assert item["probs"] == pytest.approx(w.tolist(), abs=1e-4)
        assert item["num_classes"] == 3 and item["label"] == names[int(w.argmax())]
    assert [item["index"] for item in body["data"]] == [0, 1, 2, 3]
    tokens = sum(len(tok(t).input_ids) for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                             "completion_tokens": 0}
    r = _post(server, path, {"input": texts, "use_activation": False})
    with torch.no_grad():
        logits = [hf(torch.tensor([tok(t).input_ids])).logits[0] for t in texts]
    for item, w in zip(r.json()["data"], logits, strict=True):
        assert item["probs"] == pytest.approx(w.tolist(), abs=1e-4)
        # three labels: no score; no lm_head: no completion
    r = _post(server, "/score", {"text_1": QUERY, "text_2": DOCS[0]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "classify instead" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"prompt": QUERY, "max_tokens": 2})
    assert r.status_code == 400 and "not generation" in r.json()["error"]["message"], r.text
    assert server.idle()


def test_a_pooling_runner_refuses_generation(reranker):
    r = _post(reranker, "/v1/completions", {"prompt": QUERY, "max_tokens": 2})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text
    assert reranker.idle()


def test_classify_on_the_reranker_names_its_tokens_and_on_a_plain_model_is_refused(
        reranker, embedder):
    r = _post(reranker, "/classify", {"input": QUERY + DOCS[1]})
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    assert item["num_classes"] == 2 and item["label"] in ("no", "yes")
    assert item["label"] == ("yes" if item["probs"][1] > 0.5 else "no")
    r = _post(embedder, "/classify", {"input": QUERY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "needs a classifier" in r.json()["error"]["message"]


def test_a_score_template_formats_raw_queries_and_documents(model, tmp_path, hf):
    # vLLM's --chat-template for a score model: clients send the raw query and documents, the
    # server renders Qwen3-Reranker's instruction format around them (roles query, document)
    tok, _, _ = hf
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    want = []
    for d in DOCS[:2]:
        with torch.no_grad():
            x = lm(torch.tensor([tok(reranker_text(QUERY, d), add_special_tokens=False)
                                 .input_ids])).logits[0, -1]
        want.append(torch.sigmoid(x[yes] - x[no]).item())
    template = tmp_path / "qwen3_reranker.jinja"
    template.write_text(RERANKER_TEMPLATE)
    with running_server(model, "--max-model-len", "512", "--dtype", "float32", "--runner",
                        "pooling", "--hf-overrides", json.dumps(RERANKER), "--chat-template",
                        str(template)) as server:
        r = _post(server, "/rerank", {"query": QUERY, "documents": DOCS[:2]})
        assert r.status_code == 200, r.text
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        assert [got[0], got[1]] == pytest.approx(want, abs=1e-4)
