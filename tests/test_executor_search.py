"""Search backends: BM25 scores against the formula, the on-disk index cache, the bundled corpus and
questions, a Search-R1-style remote retriever (fake, in-process), and no JAX start-up."""
import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web

from workflow_r1.task.reward import normalize_answer
from workflow_r1.executor import ExecutorClient, FakeBackend, start_in_thread
from workflow_r1.executor.search import (BUNDLED_CORPUS, BM25Search, Passage, RemoteSearch,
                                         SearchError, render_results, split_contents)
from workflow_r1.executor.server import serve_app_in_thread

pytestmark = pytest.mark.timeout(120)

BUNDLED = BUNDLED_CORPUS.parent
REPO = Path(__file__).resolve().parent.parent


def write_corpus(path: Path, docs: list[tuple[str, str]]) -> Path:
    with open(path, "w") as f:
        for i, (title, text) in enumerate(docs):
            f.write(json.dumps({"id": f"d{i}", "contents": f'"{title}"\n{text}'}) + "\n")
    return path


def test_split_contents():
    assert split_contents('"Paris"\nParis is the capital.') == ("Paris", "Paris is the capital.")
    assert split_contents('"Title with "quotes""\nbody\nmore') == ('Title with "quotes"', "body\nmore")
    assert split_contents("No quotes\ntext") == ("No quotes", "text")
    assert split_contents('"Only title"') == ("Only title", "")


def test_render_results():
    passages = [Passage("A", "alpha text", 2.0), Passage("B", "beta text", 1.0)]
    assert render_results("q x", passages) == (
        "Search results for 'q x':\n\n[1] Title: A\nText: alpha text\n\n[2] Title: B\nText: beta text")
    assert render_results("zzz", []) == "Search: No results found for query: zzz"


TINY = [("Alpha", "alpha beta gamma"), ("Beta", "beta beta delta"),
        ("Gamma", "gamma epsilon zeta eta"), ("Omega", "omega")]


def bm25_reference(docs, query, k1=1.5, b=0.75):
    """BM25 (Lucene idf, Robertson tf) from the formula, over lower-cased word tokens."""
    tokenized = [re.findall(r"\b\w\w+\b", f"{t}\n{x}".lower()) for t, x in docs]
    n, avg = len(tokenized), sum(map(len, tokenized)) / len(tokenized)
    scores = []
    for toks in tokenized:
        tf = Counter(toks)
        s = 0.0
        for term in set(query.lower().split()):
            df = sum(term in d for d in tokenized)
            if df == 0 or term not in tf:
                continue
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            s += idf * tf[term] / (tf[term] + k1 * (1 - b + b * len(toks) / avg))
        scores.append(s)
    return scores


def test_bm25_scores_match_the_formula(tmp_path):
    search = BM25Search(write_corpus(tmp_path / "tiny.jsonl", TINY), cache_dir=tmp_path / "cache")
    for query in ("beta", "gamma beta", "omega", "zeta delta alpha"):
        reference = bm25_reference(TINY, query)
        expected = sorted((i for i, s in enumerate(reference) if s > 0), key=lambda i: -reference[i])
        got = search.search_sync(query, topk=4)
        assert [p.title for p in got] == [TINY[i][0] for i in expected], query
        for p, i in zip(got, expected):
            assert p.score == pytest.approx(reference[i], rel=1e-5)
    reference = bm25_reference(TINY, "gamma beta")
    best = max(range(len(TINY)), key=lambda i: reference[i])
    assert [p.title for p in search.search_sync("gamma beta", topk=1)] == [TINY[best][0]]
    assert search.search_sync("unknownword", 3) == []
    assert search.search_sync("the of and", 3) == []  # stopwords only
    assert search.search_sync("", 3) == []


def test_plural_folding_matches_singular_queries(tmp_path):
    docs = [("Rivers", "Great rivers of cities"), ("Cats", "a cat sat")]
    search = BM25Search(write_corpus(tmp_path / "p.jsonl", docs), cache_dir=tmp_path / "cache")
    assert search.search_sync("river", 1)[0].title == "Rivers"
    assert search.search_sync("city", 1)[0].title == "Rivers"
    assert search.search_sync("cats", 1)[0].title == "Cats"


def test_index_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKFLOW_R1_CACHE", str(tmp_path / "root"))
    corpus = write_corpus(tmp_path / "c.jsonl", TINY)
    first = BM25Search(corpus)
    assert first.built_index and first.index_dir.parent == tmp_path / "root" / "bm25"
    files = {p.name: p.stat().st_mtime_ns for p in first.index_dir.iterdir()}
    second = BM25Search(corpus)
    assert not second.built_index and second.index_dir == first.index_dir
    assert {p.name: p.stat().st_mtime_ns for p in first.index_dir.iterdir()} == files
    assert [p.title for p in second.search_sync("beta", 2)] == [p.title for p in first.search_sync("beta", 2)]
    # A different corpus gets a different index; no temp directories are left behind.
    other = BM25Search(write_corpus(tmp_path / "d.jsonl", TINY[:3]))
    assert other.built_index and other.index_dir != first.index_dir
    assert sorted(p.name for p in (tmp_path / "root" / "bm25").iterdir()) == sorted(
        [first.index_dir.name, other.index_dir.name])


def test_corrupt_cache_is_rebuilt(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", TINY)
    first = BM25Search(corpus, cache_dir=tmp_path / "cache")
    (first.index_dir / "params.index.json").write_text("{broken")
    again = BM25Search(corpus, cache_dir=tmp_path / "cache")
    assert again.built_index and again.search_sync("omega", 1)[0].title == "Omega"


def test_corpus_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "\\"A\\"\\ntext"}\n{"id": "2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        BM25Search(bad, cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="bm25:PATH"):
        BM25Search(tmp_path / "missing.jsonl", cache_dir=tmp_path)
    os.mkfifo(tmp_path / "fifo.jsonl")  # read, it would block forever; /dev/zero would fill memory
    for special in (tmp_path / "fifo.jsonl", "/dev/zero"):
        with pytest.raises(ValueError, match=rf"^corpus {special}: not a regular file \(a pipe, socket or device\)"):
            BM25Search(special, cache_dir=tmp_path)


def test_bm25_does_not_start_jax(tmp_path):
    code = ("import sys; from workflow_r1.executor.search import BM25Search; "
            f"s = BM25Search(cache_dir={str(tmp_path)!r}); s.search_sync('Nile', 3); "
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------------
# Bundled data

def load_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_bundled_files_are_small_and_well_formed():
    corpus, questions = load_jsonl(BUNDLED / "corpus.jsonl"), load_jsonl(BUNDLED / "questions.jsonl")
    total = sum(p.stat().st_size for p in BUNDLED.iterdir())
    assert total < 1_000_000
    assert 300 <= len(corpus) <= 1000 and 90 <= len(questions) <= 200
    assert len({r["id"] for r in corpus}) == len(corpus)
    assert len({r["id"] for r in questions}) == len(questions)
    for row in corpus:
        assert set(row) == {"id", "contents"} and re.match(r'^".+"\n.+', row["contents"], re.S)
    for row in questions:
        assert set(row) == {"id", "question", "golden_answers", "data_source"}
        assert row["data_source"] == "bundled" and row["golden_answers"]
    assert "License" in (BUNDLED / "README.md").read_text()


def test_every_bundled_answer_is_in_the_corpus():
    corpus = load_jsonl(BUNDLED / "corpus.jsonl")
    text = " ".join(normalize_answer(r["contents"]) for r in corpus)
    for row in load_jsonl(BUNDLED / "questions.jsonl"):
        assert any(f" {normalize_answer(g)} " in f" {text} " for g in row["golden_answers"]), row


def test_bm25_finds_the_answers_of_the_bundled_questions(tmp_path):
    search = BM25Search(cache_dir=tmp_path)
    questions = load_jsonl(BUNDLED / "questions.jsonl")
    hits = 0
    for row in questions:
        top5 = search.search_sync(row["question"], 5)
        found = " ".join(normalize_answer(f"{p.title} {p.text}") for p in top5)
        hits += any(normalize_answer(g) in found for g in row["golden_answers"])
    assert hits / len(questions) >= 0.9
    assert search.search_sync("What is the capital of France?", 3)[0].title == "France"


# ------------------------------------------------------------------------------------------------
# Remote retriever (Search-R1 retrieval server protocol)

class FakeRetriever:
    def __init__(self, script=(), with_scores=True):
        self.script = list(script)
        self.with_scores = with_scores
        self.requests = []

    def app(self):
        app = web.Application()
        app.router.add_post("/retrieve", self.handle)
        return app

    async def handle(self, request):
        body = await request.json()
        self.requests.append(body)
        mode = self.script.pop(0) if self.script else "ok"
        if mode == "500":
            return web.Response(status=500, text="boom")
        if mode == "404":
            return web.Response(status=404, text="no such index")
        if mode == "garbage":
            return web.Response(text="<html>", content_type="text/html")
        results = []
        for q in body["queries"]:
            docs = [{"id": str(i), "contents": f'"Doc {i} for {q}"\nText {i}.'} for i in range(body["topk"])]
            results.append([{"document": d, "score": 10.0 - i} for i, d in enumerate(docs)]
                           if self.with_scores else docs)
        return web.json_response({"result": results})


@pytest.fixture()
def retriever():
    handles = []

    def make(*script, with_scores=True):
        fake = FakeRetriever(script, with_scores)
        handle = serve_app_in_thread(fake.app)
        handles.append(handle)
        return fake, handle.url

    yield make
    for h in handles:
        h.stop()


def search_once(backend, query, topk):
    import asyncio

    async def run():
        try:
            return await backend.search(query, topk)
        finally:
            await backend.aclose()
    return asyncio.run(run())


@pytest.mark.parametrize("with_scores", [True, False])
def test_remote_search_protocol(retriever, with_scores):
    fake, url = retriever(with_scores=with_scores)
    passages = search_once(RemoteSearch(url), "nile", 3)
    assert fake.requests == [{"queries": ["nile"], "topk": 3, "return_scores": True}]
    assert [p.title for p in passages] == ["Doc 0 for nile", "Doc 1 for nile", "Doc 2 for nile"]
    assert passages[0].text == "Text 0." and passages[0].doc_id == "0"
    assert [p.score for p in passages] == ([10.0, 9.0, 8.0] if with_scores else [0.0] * 3)


def test_remote_search_retries_5xx_and_reports_failures(retriever):
    fake, url = retriever("500", "ok")
    assert len(search_once(RemoteSearch(url, backoff_s=0.01), "q", 2)) == 2
    assert len(fake.requests) == 2
    for script, match in ((("500",) * 3, "after 3 attempts"), (("404",), "HTTP 404"),
                          (("garbage",), "unparseable")):
        fake, url = retriever(*script)
        with pytest.raises(SearchError, match=match):
            search_once(RemoteSearch(url, backoff_s=0.01), "q", 2)


def test_search_operator_with_failing_remote_gives_error_observation(retriever):
    fake, url = retriever(*("500",) * 3)
    with start_in_thread(FakeBackend(), RemoteSearch(url, backoff_s=0.01)) as handle:
        with ExecutorClient(handle.url, timeout_s=30) as client:
            [obs] = client.execute_many_sync([("Search", "anything")])
    assert obs.error_kind == "search_error" and obs.text.startswith("Search error: retrieval failed")
