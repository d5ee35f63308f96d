"""A real document collection that is on every machine: the docstrings of Python's
standard library. Used by the demo, the benchmarks and the example notebook, so that
nothing is downloaded.

Each chunk is a (source_id, text) pair; source ids are stable ("json.JSONDecoder"),
and the collection is deterministic for a given Python version.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

MODULES = ("argparse", "asyncio", "calendar", "collections", "concurrent.futures", "configparser",
           "csv", "datetime", "decimal", "difflib", "email.message", "fractions", "ftplib",
           "functools", "gzip", "http.client", "imaplib", "ipaddress", "json", "logging",
           "mailbox", "optparse", "pathlib", "pickle", "random", "re", "sched", "shutil", "smtplib",
           "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile",
           "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid", "warnings",
           "zipfile")


@dataclass(frozen=True)
class DocChunk:
    source_id: str
    text: str


def _documented(module_name: str):
    module = importlib.import_module(module_name)
    yield module_name, inspect.getdoc(module)
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            yield f"{module_name}.{name}", inspect.getdoc(value)
        elif inspect.isclass(value):
            yield f"{module_name}.{name}", inspect.getdoc(value)
            for method_name, method in sorted(vars(value).items()):
                if inspect.isfunction(method) and not method_name.startswith("_"):
                    yield f"{module_name}.{name}.{method_name}", inspect.getdoc(method)


def _normalize(text: str) -> str:
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
    return "\n".join(p for p in paragraphs if p)


def stdlib_chunks(min_chars: int = 250, max_chars: int = 1200, limit: int | None = None) -> list[DocChunk]:
    """Docstrings of MODULES between min_chars and max_chars long (cut at max_chars on a word)."""
    chunks = []
    for module_name in MODULES:
        for source_id, doc in _documented(module_name):
            if not doc or len(doc) < min_chars:
                continue
            text = _normalize(doc)
            if len(text) > max_chars:
                text = text[:max_chars].rsplit(" ", 1)[0]
            chunks.append(DocChunk(source_id, text))
    return chunks[:limit] if limit else chunks
