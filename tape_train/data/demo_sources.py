"""Which demo corpus ``tape-data prepare --demo`` builds (``--demo-source``):

* ``debian``: Debian's documentation packages, fetched with apt (``demo_corpus.py``);
  without the apt tools, or with none of the packages downloadable, a clear error;
* ``python``: the running interpreter's own standard library (``stdlib_corpus.py``), which
  needs nothing else;
* ``auto`` (the default): Debian's where apt is there and works, else the standard library's,
  with one WARNING line saying why.

The two are different text: perplexities measured on one are not comparable with the other's.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from tape_train.data.corpus import DocumentSource

log = logging.getLogger("tape_train.data")

DEMO_SOURCES = ("auto", "debian", "python")
# The standard library gives ~450 documents (against Debian's ~31 000): 1 % would hold out
# ~4 of them, too few for the demo's evaluation (8192 predictions, up to 1024 tokens long).
EVAL_FRACTION = {"python": 0.05}  # --eval-fraction's default for it; else prepare's (0.01)


def candidates(requested: str) -> tuple[str, ...]:
    """The sources ``requested`` may end up as, in the order they are tried."""
    return ("debian", "python") if requested == "auto" else (requested,)


def demo_config(source: str) -> dict:
    """The manifest's ``config`` entry naming a demo corpus of ``source``. Debian's is what
    corpora prepared before the standard-library source existed carry, so they stay
    complete."""
    return {"demo": True} if source == "debian" else {"demo": True, "demo_source": source}


@dataclass(frozen=True)
class DemoCorpus:
    source: str                # "debian" or "python"
    documents: DocumentSource
    extra: dict                # what the manifest records of it
    inputs: dict               # what identifies its input (an interrupted prepare resumes on it)


def _debian(cache_dir: Path) -> DemoCorpus:
    from tape_train.data import demo_corpus

    debs = demo_corpus.fetch_demo_packages(cache_dir)
    return DemoCorpus(
        "debian", functools.partial(demo_corpus.iter_demo_documents, debs),
        extra={"demo_source": "debian",
               "packages": {name: version for name, (_, version) in debs.items()}},
        inputs={"packages": {name: [version, deb.stat().st_size]
                             for name, (deb, version) in debs.items()}})


def _python() -> DemoCorpus:
    from tape_train.data import stdlib_corpus

    root = stdlib_corpus.stdlib_root()
    fingerprint = stdlib_corpus.stdlib_fingerprint(root)
    log.info("prepare: the demo corpus from %s %s's standard library (%s): %d files, sha256 "
             "%s", fingerprint["implementation"], fingerprint["version"], root,
             fingerprint["files"], fingerprint["sha256"][:12])
    return DemoCorpus("python", functools.partial(stdlib_corpus.iter_stdlib_documents, root),
                      extra={"demo_source": "python", "python": fingerprint},
                      inputs={"python": fingerprint})


def open_demo_corpus(requested: str, cache_dir: Path) -> DemoCorpus:
    """The demo corpus of ``requested`` (one of DEMO_SOURCES), its packages downloaded into
    ``cache_dir`` if Debian's. ``auto`` falls back to the standard library only where the
    Debian source is unavailable here (``DemoSourceUnavailable``); any other error (an
    unwritable ``cache_dir``) is raised as it is."""
    if requested == "python":
        return _python()
    from tape_train.data.demo_corpus import DemoSourceUnavailable

    try:
        return _debian(cache_dir)
    except DemoSourceUnavailable as exc:
        if requested == "debian":
            raise
        from tape_train.data.stdlib_corpus import python_identity

        python = python_identity()
        log.warning("prepare --demo: Debian's documentation packages cannot be used (%s); "
                    "building the demo corpus from this %s %s's standard library instead: "
                    "its perplexities are not comparable with the Debian corpus's "
                    "(--demo-source python chooses it without this warning)",
                    exc.why, python["implementation"], python["version"])
        return _python()
