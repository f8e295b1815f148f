"""The local search tool: BM25 over a corpus file, the offline stand-in for a web search.

A query ``Q`` scores document ``D`` by Okapi BM25 (a few lines over an inverted index):

    score(D, Q) = sum over distinct q in Q of
                  IDF(q) * f(q, D) * (k1 + 1) / (f(q, D) + k1 * (1 - b + b * |D| / avgdl))
    IDF(q)      = ln(1 + (N - n(q) + 0.5) / (n(q) + 0.5))

with ``f(q, D)`` the count of ``q`` in ``D``, ``|D|`` its length in terms, ``avgdl`` the
mean length, ``N`` the number of documents and ``n(q)`` how many contain ``q``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.buffer.sources import DataError, read_objects
from asyncrl.rollout.tools.registry import FunctionTool

_TERM = re.compile(r"[^\W_]+")


def terms(text: str) -> list[str]:
    """Lower-cased runs of letters and digits."""
    return _TERM.findall(text.lower())


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class Hit:
    document: Document
    score: float


class BM25Index:
    """An inverted index over ``documents``; ``search(query, k)`` ranks them by BM25."""

    def __init__(self, documents: list[Document], k1: float = 1.5, b: float = 0.75) -> None:
        self.documents, self.k1, self.b = documents, k1, b
        counts = [Counter(terms(f"{d.title} {d.text}")) for d in documents]
        self._lengths = np.array([sum(c.values()) for c in counts], dtype=np.float64)
        self._avgdl = float(self._lengths.mean()) if documents else 0.0
        self._postings: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        by_term: dict[str, list[tuple[int, int]]] = {}
        for i, c in enumerate(counts):
            for term, f in c.items():
                by_term.setdefault(term, []).append((i, f))
        for term, pairs in by_term.items():
            docs, freqs = zip(*pairs, strict=True)
            self._postings[term] = (np.array(docs), np.array(freqs, dtype=np.float64))

    def idf(self, term: str) -> float:
        n = len(self._postings.get(term, ((), ()))[0])
        return float(np.log1p((len(self.documents) - n + 0.5) / (n + 0.5)))

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The ``k`` best documents with a positive score, best first (ties: corpus order)."""
        scores = np.zeros(len(self.documents))
        norm = self.k1 * (1 - self.b + self.b * self._lengths / max(self._avgdl, 1e-9))
        for term in set(terms(query)):
            if term not in self._postings:
                continue
            docs, f = self._postings[term]
            scores[docs] += self.idf(term) * f * (self.k1 + 1) / (f + norm[docs])
        order = np.argsort(-scores, kind="stable")[:k]
        return [Hit(self.documents[i], float(scores[i])) for i in order if scores[i] > 0]


def load_corpus(spec: str) -> list[Document]:
    """The documents of ``spec``, a jsonl or parquet file (``path@[a:b]`` slicing as for
    prompts): a row each, ``text`` (a string: else a ``DataError``) and optionally
    ``title`` and ``id``."""
    docs = []
    for n, (where, row) in enumerate(read_objects(spec)):
        text = row.get("text")
        if not isinstance(text, str):
            raise DataError(f"{where}: a corpus row needs a string 'text'")
        docs.append(Document(str(row.get("id", n)), str(row.get("title", "")), text))
    return docs


class SearchTool:
    """``search(query)``: the top ``k`` documents, each cut to ``max_chars`` characters."""

    def __init__(self, index: BM25Index, k: int = 3, max_chars: int = 500) -> None:
        self.index, self.k, self.max_chars = index, k, max_chars

    def __call__(self, query: str) -> str:
        """Sync on purpose: scoring touches every posting, so the registry runs it in a thread."""
        hits = self.index.search(query, self.k)
        if not hits:
            return "No results."
        return "\n\n".join(self._show(i, h) for i, h in enumerate(hits, 1))

    def _show(self, rank: int, hit: Hit) -> str:
        doc = hit.document
        text = doc.text if len(doc.text) <= self.max_chars else doc.text[: self.max_chars] + "..."
        head = f"[{rank}] {doc.title}" if doc.title else f"[{rank}]"
        return f"{head} (id {doc.id})\n{text}"


SEARCH_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"query": {"type": "string", "description": "Words to look for."}},
    "required": ["query"],
    "additionalProperties": False,
}


def search_tool(corpus: str, k: int = 3, max_chars: int = 500) -> FunctionTool:
    """A registry tool named ``search`` over the corpus file ``corpus``."""
    tool = SearchTool(BM25Index(load_corpus(corpus)), k, max_chars)
    return FunctionTool(
        "search", "Search the local document collection.", tool.__call__, SEARCH_PARAMETERS
    )
