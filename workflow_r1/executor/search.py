"""Search backends for the Search operator: local BM25 over a jsonl corpus, or a remote retriever.

Corpus format (FlashRAG / Search-R1): one JSON object per line, `{"id": ..., "contents": ...}`,
where `contents` is the title in double quotes on the first line, then the passage text.

- `BM25Search`: the `bm25s` package; the index is built once per corpus content and cached in
  `$WORKFLOW_R1_CACHE/bm25/<sha256 of corpus + tokenizer settings>` (default cache root
  `~/.cache/workflow_r1`). Nothing is downloaded: English stopwords ship with bm25s and the
  stemmer is a small plural folder written here.
- `RemoteSearch`: a Search-R1-style retrieval server, `POST {url}/retrieve` with
  `{"queries": [...], "topk": k, "return_scores": true}`.

`render_results` turns passages into the observation text: numbered "Title / Text" blocks, or the
paper's web-search layout of "Title / Snippet" blocks with each text cut to a snippet.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import aiohttp
import numpy as np

from workflow_r1 import storage
from workflow_r1.assets.cache import cache_root
from workflow_r1.executor.httpio import UPSTREAM_REPLY_BYTES, ReplyTooLarge, check_url, read_capped

_log = logging.getLogger(__name__)

BUNDLED_CORPUS = Path(__file__).resolve().parent.parent / "bundled" / "corpus.jsonl"
_TOKENIZER_VERSION = "bm25s-en-stopwords+plural-fold-v1"  # part of the cache key
# BM25 searches run on the event loop itself only when cheap: at most this many passages and
# query characters (beyond either, a worker thread).
_INLINE_MAX_PASSAGES = 50_000
_INLINE_MAX_QUERY_CHARS = 1_000


@dataclass(frozen=True)
class Passage:
    """One retrieved passage; score is the retriever's (higher is better), 0.0 when unknown."""

    title: str
    text: str
    score: float = 0.0
    doc_id: str = ""


class SearchError(Exception):
    """A search backend failed; the message becomes the observation text."""


@runtime_checkable
class SearchBackend(Protocol):
    name: str

    async def search(self, query: str, topk: int) -> list[Passage]: ...


def split_contents(contents: str) -> tuple[str, str]:
    """FlashRAG `contents` -> (title, text): the first line, quotes stripped, and the rest."""
    first, _, rest = contents.partition("\n")
    title = first.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, rest.strip()


SNIPPET_ELLIPSIS = "..."


def snippet(text: str, max_chars: int) -> str:
    """`text`, whitespace collapsed, cut to at most `max_chars` (>= 3) characters: at the last word
    boundary that fits, with SNIPPET_ELLIPSIS appended (counted in the limit); whole if it fits."""
    text = " ".join(text.split())
    if len(text) <= max_chars:
        return text
    room = max(max_chars - len(SNIPPET_ELLIPSIS), 0)
    cut = text[:room + 1].rfind(" ")  # +1: a space right after the cut is a word boundary too
    head = text[:cut] if cut > 0 else text[:room]
    return head.rstrip(" ,;:") + SNIPPET_ELLIPSIS


def render_results(query: str, passages: Sequence[Passage], snippet_chars: int = 0) -> str:
    """Observation text for a search, or a no-results line.

    snippet_chars 0: numbered "[i] Title: ...\\nText: FULL TEXT" blocks. snippet_chars > 0: the
    release's web-search layout, "Title: ...\\nSnippet: ..." blocks with each text cut by `snippet`.
    """
    if not passages:
        return f"Search: No results found for query: {query}"
    if snippet_chars > 0:
        blocks = [f"Title: {p.title}\nSnippet: {snippet(p.text, snippet_chars)}" for p in passages]
    else:
        blocks = [f"[{i}] Title: {p.title}\nText: {p.text}" for i, p in enumerate(passages, 1)]
    return f"Search results for '{query}':\n\n" + "\n\n".join(blocks)


def _fold_plurals(words: list[str]) -> list[str]:
    # A tiny stemmer so "rivers" meets "river" without a stemmer package or downloads:
    # "cities" -> "city", "boxes" -> "box", "rivers" -> "river"; "glass", "is", "gas" stay.
    out = []
    for w in words:
        if len(w) > 4 and w.endswith("ies"):
            w = w[:-3] + "y"
        elif len(w) > 4 and w.endswith(("ches", "shes", "xes", "sses")):
            w = w[:-2]
        elif len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
            w = w[:-1]
        out.append(w)
    return out


def _import_bm25s():
    """Import bm25s without letting it start JAX.

    bm25s probes for JAX at import and runs a tiny `jax.lax.top_k`, which in a standalone executor
    process on a GPU host would initialise the accelerator and preallocate most of its memory
    beside the trainer. When JAX is not imported yet, make `import jax` fail for that one import
    so bm25s falls back to NumPy (we never use its JAX path anyway).
    """
    if "bm25s" in sys.modules or "jax" in sys.modules:
        import bm25s
        return bm25s
    sys.modules["jax"] = None  # type: ignore[assignment]  # "import jax" now raises ImportError
    try:
        import bm25s
    finally:
        if sys.modules.get("jax", 0) is None:
            del sys.modules["jax"]
    return bm25s


def load_corpus(path: str | os.PathLike) -> list[Passage]:
    """Read a FlashRAG/Search-R1 jsonl corpus; errors name the file and line."""
    if os.path.isdir(path):
        raise ValueError(f"corpus {path}: a directory; pass a FlashRAG-format jsonl file")
    storage.refuse_special(path, "corpus")
    passages = []
    # utf-8-sig: a corpus saved by an editor that starts the file with a byte-order mark still reads.
    with open(path, encoding="utf-8-sig") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    title, text = split_contents(row["contents"])
                    passages.append(Passage(title=title, text=text, doc_id=str(row.get("id", lineno))))
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    raise ValueError(
                        f"{path}:{lineno}: not a corpus row ({type(exc).__name__}: {exc}); expected "
                        '{"id": ..., "contents": "\\"Title\\"\\ntext"}'
                    ) from None
        except UnicodeDecodeError as exc:  # raised by the file iterator, not by json.loads
            raise ValueError(f"corpus {path} is not UTF-8 ({exc.reason}); save it as UTF-8") from None
    if not passages:
        raise ValueError(f"corpus {path} has no passages")
    return passages


class BM25Search:
    """BM25 over a local jsonl corpus, index cached on disk.

    Args:
        corpus_path: the jsonl corpus; default the bundled one.
        cache_dir: where indexes live; default `cache_root()/bm25`.
    Attributes:
        index_dir: this corpus's index directory; `built_index` says whether this instance built it
            (False: it was loaded from the cache).
    """

    name = "bm25"

    def __init__(self, corpus_path: str | os.PathLike | None = None,
                 cache_dir: str | os.PathLike | None = None):
        self.corpus_path = Path(corpus_path) if corpus_path else BUNDLED_CORPUS
        if not self.corpus_path.exists():
            raise FileNotFoundError(
                f"search corpus {self.corpus_path} not found; pass a FlashRAG-format jsonl file "
                "(--search bm25:PATH) or use the bundled corpus (--search bm25)"
            )
        self._bm25s = _import_bm25s()
        # bm25s sets its logger to DEBUG at import; under an absl app (its handler sits on the root
        # logger) the index-build messages would reach stderr, ahead of the CLI's "listening" line.
        logging.getLogger("bm25s").setLevel(logging.WARNING)
        self.passages = load_corpus(self.corpus_path)
        digest = hashlib.sha256(self.corpus_path.read_bytes())
        digest.update(_TOKENIZER_VERSION.encode())
        root = Path(cache_dir) if cache_dir else cache_root() / "bm25"
        self.index_dir = root / digest.hexdigest()[:20]
        self.built_index = False
        self.retriever = self._load_or_build()

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, lower=True, stopwords="en", stemmer=_fold_plurals,
                                    return_ids=False, show_progress=False)

    def _load_or_build(self):
        bm25s = self._bm25s
        if (self.index_dir / "params.index.json").is_file():
            try:
                return bm25s.BM25.load(str(self.index_dir), show_progress=False)
            except Exception:  # a corrupt cache entry is rebuilt, not fatal
                shutil.rmtree(self.index_dir, ignore_errors=True)
        docs = [f"{p.title}\n{p.text}" for p in self.passages]
        retriever = bm25s.BM25()
        retriever.index(self._tokenize(docs), show_progress=False)
        self.index_dir.parent.mkdir(parents=True, exist_ok=True)
        # Write to a temp dir and rename, so concurrent builders never expose half an index.
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.index_dir.parent))
        try:
            retriever.save(str(tmp), show_progress=False)
            try:
                tmp.rename(self.index_dir)
            except OSError:  # another process won the race; its index is identical
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.built_index = True
        return retriever

    def search_sync(self, query: str, topk: int) -> list[Passage]:
        """Top-`topk` passages with a positive BM25 score, best first."""
        tokens = [t for t in self._tokenize([query])[0] if t in self.retriever.vocab_dict]
        if not tokens or topk <= 0:
            return []
        scores = np.asarray(self.retriever.get_scores(tokens), dtype=np.float64)
        k = min(topk, scores.shape[0])
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [
            Passage(self.passages[i].title, self.passages[i].text, float(scores[i]),
                    self.passages[i].doc_id)
            for i in top if scores[i] > 0
        ]

    async def search(self, query: str, topk: int) -> list[Passage]:
        if len(self.passages) <= _INLINE_MAX_PASSAGES and len(query) <= _INLINE_MAX_QUERY_CHARS:
            return self.search_sync(query, topk)  # sub-millisecond: a thread hop would cost more
        # A large corpus or a long query (up to the content limit) costs milliseconds to seconds:
        # off the event loop, so other calls and /health keep being served meanwhile.
        return await asyncio.to_thread(self.search_sync, query, topk)


class RemoteSearch:
    """Client for a Search-R1-style retrieval server.

    Request: `POST {url}/retrieve` `{"queries": [q], "topk": k, "return_scores": true}`. Reply:
    `{"result": [[{"document": {"id", "contents"}, "score": s}, ...]]}`, or without scores
    `{"result": [[{"id", "contents"}, ...]]}`. Timeouts, connection errors and 5xx are retried
    `retries` times with a short backoff; anything else raises SearchError at once.

    At most `max_concurrency` requests are in flight; more wait their turn *before* their attempt's
    `timeout_s` starts, so a burst of searches against a healthy server queues instead of timing
    out (the timeout measures the retriever, not the queue). A reply over `max_reply_bytes` is a
    SearchError. Error messages (which the policy reads) do not name the server; the log does.
    """

    name = "remote"

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 2,
                 backoff_s: float = 0.5, max_concurrency: int = 64,
                 max_reply_bytes: int = UPSTREAM_REPLY_BYTES):
        check_url(url, "retrieval server URL", "http://localhost:8002")
        base = url.rstrip("/")
        self.url = base if base.endswith("/retrieve") else base + "/retrieve"
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_concurrency = max_concurrency
        self.max_reply_bytes = max_reply_bytes
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()

    async def search(self, query: str, topk: int) -> list[Passage]:
        if self._session is None or self._session.closed:
            # As many pooled connections as slots, so a request holding a slot never waits for one.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrency))
            self._slots = asyncio.Semaphore(self.max_concurrency)
        assert self._slots is not None
        payload = {"queries": [query], "topk": topk, "return_scores": True}
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * attempt)
            async with self._slots:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        status, body = await self._post(payload)
                except TimeoutError:
                    last = f"no reply within {self.timeout_s:g} s"
                    continue
                except aiohttp.ClientError as exc:
                    last = f"cannot reach it ({type(exc).__name__})"
                    _log.warning("retrieval server %s: %s: %s", self.url, type(exc).__name__, exc)
                    continue
                except ReplyTooLarge as exc:
                    raise SearchError(f"the retrieval server's {exc}") from None
            if status >= 500:
                last = f"HTTP {status}"
                continue
            if status != 200:
                _log.warning("retrieval server %s answered HTTP %d", self.url, status)
                raise SearchError(f"the retrieval server answered HTTP {status}: "
                                  f"{body[:200].decode('utf-8', 'replace')}")
            return _parse_retrieve_reply(body)[:topk]
        _log.warning("retrieval server %s failed after %d attempts: %s", self.url,
                     self.retries + 1, last)
        raise SearchError(f"retrieval failed after {self.retries + 1} attempts: {last}")

    async def _post(self, payload: dict) -> tuple[int, bytes]:
        assert self._session is not None
        async with self._session.post(self.url, json=payload) as resp:
            return resp.status, await read_capped(resp, self.max_reply_bytes)


def _parse_retrieve_reply(body: bytes) -> list[Passage]:
    try:
        data: Any = json.loads(body)
        hits = data["result"][0]
        passages = []
        for hit in hits:
            doc = hit.get("document", hit)
            title, text = split_contents(doc["contents"])
            passages.append(Passage(title, text, float(hit.get("score", 0.0) or 0.0),
                                    str(doc.get("id", ""))))
        return passages
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as exc:
        raise SearchError(f"unparseable reply from the retrieval server "
                          f"({type(exc).__name__}: {exc})") from None
