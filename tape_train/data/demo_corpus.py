"""The demo corpus: real English prose and documentation from Debian packages.

Packages are fetched with ``apt-get download`` into a cache directory and unpacked with
``dpkg-deb -x`` into a temporary directory — nothing is installed system-wide; stale or missing
package lists are refreshed into the cache directory, never the system's. Each package
has an extractor that turns its files into documents:

=====================  ==============================================  ======================
package                files                                           one document per
=====================  ==============================================  ======================
python3.N-doc          ``usr/share/doc/python3.N/html/_sources/**/*.rst.txt``  file (reST)
perl-doc               ``usr/share/perl/5.*/pod/*.pod``                file (POD)
dict-jargon/foldoc/    ``usr/share/dictd/*.index`` + ``*.dict.dz``     dictionary entry
devil
fortunes, fortunes-min ``usr/share/games/fortunes/*``                  ``%``-separated entry
gnu-standards          ``usr/share/doc/gnu-standards/*.text.gz``       file
debian-reference-en    ``usr/share/debian-reference/*.txt.gz``         file
=====================  ==============================================  ======================
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tape_train.data.config import DataError

log = logging.getLogger("tape_train.data")

FIXED_PACKAGES = ("perl-doc", "dict-jargon", "dict-foldoc", "dict-devil", "fortunes",
                  "fortunes-min", "gnu-standards", "debian-reference-en")
_DICTD_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


class DemoSourceUnavailable(DataError):
    """Debian's packages cannot be had here: no apt tools, or none could be downloaded.
    ``why`` says which in a few words (``--demo-source auto`` names it when it falls back)."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


def require_apt() -> None:
    for tool in ("apt-get", "apt-cache", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise DemoSourceUnavailable(
                f"prepare --demo needs {tool} (a Debian/Ubuntu machine); use --demo-source "
                f"python for the demo corpus from this Python's standard library, or "
                f"`tape-data prepare --input <files>` for other text",
                why=f"{tool} not found on PATH")


# python3.N-doc for any N here; the newest the archive has is used.
_PYTHON_DOC_CANDIDATES = tuple(f"python3.{minor}-doc" for minor in range(8, 21))


def _private_lists_options(lists_dir: Path) -> list[str]:
    """apt options that read (and ``apt-get update`` writes) package lists in ``lists_dir``
    instead of the system's: no root needed, the system's lists are left alone. The binary
    caches are switched off so apt builds them in memory from those lists."""
    return ["-o", f"Dir::State::Lists={lists_dir}", "-o", "Dir::Cache::pkgcache=",
            "-o", "Dir::Cache::srcpkgcache=", "-o", "Debug::NoLocking=1"]


def available_versions(names: list[str], apt_options: list[str]) -> dict[str, str]:
    """``{package: candidate version}`` for the names apt knows, in ONE ``apt-cache`` call
    (each call re-reads the package lists, seconds on a loaded machine)."""
    out = _run(["apt-cache", *apt_options, "show", "--no-all-versions", *names])
    found: dict[str, str] = {}
    for stanza in out.stdout.split("\n\n"):
        package = re.search(r"^Package: (\S+)", stanza, re.M)
        version = re.search(r"^Version: (\S+)", stanza, re.M)
        if package and version:
            found.setdefault(package.group(1), version.group(1))
    return found


def demo_packages(apt_options: list[str]) -> dict[str, str]:
    """The demo packages apt knows, ``{name: version}``: the newest python3.N-doc and every
    package of FIXED_PACKAGES that the lists have."""
    found = available_versions([*_PYTHON_DOC_CANDIDATES, *FIXED_PACKAGES], apt_options)
    python_docs = [n for n in _PYTHON_DOC_CANDIDATES if n in found]
    chosen = {python_docs[-1]: found[python_docs[-1]]} if python_docs else {}
    chosen.update((name, found[name]) for name in FIXED_PACKAGES if name in found)
    return chosen


def _unwritable_cache(cache_dir: Path, names: list[str], why: str) -> str:
    which = f"{len(names)} package(s) ({names[0]}, ...)" if names else "the demo packages"
    return (f"prepare --demo: cannot download {which} into {cache_dir}: {why}; give "
            f"--cache-dir a writable directory, or set TAPE_TRAIN_CACHE_DIR")


def download_packages(wanted: dict[str, str], cache_dir: Path,
                      apt_options: list[str]) -> dict[str, tuple[Path, str]]:
    """``{name: (.deb path, version)}`` for the packages of ``wanted`` that are cached or
    could be downloaded now; the others are left out. Cached ``.deb`` files of the right
    version are reused."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(_unwritable_cache(cache_dir, list(wanted), exc.strerror or str(exc))
                        ) from None

    def cached(name: str, version: str) -> Path | None:
        # apt-get download names files <name>_<version with ':' as %3a>_<arch>.deb
        quoted = version.replace(":", "%3a")
        hits = sorted(cache_dir.glob(f"{name}_{quoted}_*.deb"))
        return hits[0] if hits else None

    missing = [n for n, v in wanted.items() if cached(n, v) is None]
    # Else apt-get would fetch each package from the archive only to fail writing it.
    if missing and not os.access(cache_dir, os.W_OK | os.X_OK):
        raise DataError(_unwritable_cache(cache_dir, missing, "not writable"))
    if missing:
        log.info("prepare: apt-get download %s (into %s)", " ".join(missing), cache_dir)
        out = _run(["apt-get", *apt_options, "download", *missing], cwd=cache_dir)
        if out.returncode != 0:
            log.info("prepare: apt-get download failed (%s); trying packages one by one",
                     out.stderr.strip().splitlines()[-1:] or out.returncode)
            for name in missing:
                one = _run(["apt-get", *apt_options, "download", name], cwd=cache_dir)
                if one.returncode != 0:
                    log.info("prepare: cannot download %s: %s", name, one.stderr.strip()[-300:])
    found = {name: cached(name, version) for name, version in wanted.items()}
    return {name: (deb, wanted[name]) for name, deb in found.items() if deb is not None}


def fetch_demo_packages(cache_dir: Path) -> dict[str, tuple[Path, str]]:
    """Download the demo packages into ``cache_dir``: ``{name: (.deb path, version)}``.

    The machine's package lists are tried first (or those an earlier run fetched). Where they
    lack a demo package, or name a version the archive no longer serves (lists older than the
    archive's last point release: ``apt-get download`` gets a 404), the lists are fetched
    afresh into ``cache_dir/apt-lists`` (``apt-get update`` with private options: no root
    needed, the machine's lists untouched) and the rest is downloaded with those. Packages still missing then are skipped with a warning;
    none at all is an error."""
    require_apt()
    update_error = None
    lists_dir = cache_dir / "apt-lists"
    private = _private_lists_options(lists_dir)
    # Lists fetched by an earlier run are at least as new as the machine's were then.
    first = private if any(lists_dir.glob("*Packages*")) else []
    debs = download_packages(demo_packages(first), cache_dir, first)
    has_python_doc = any(name in debs for name in _PYTHON_DOC_CANDIDATES)
    if not has_python_doc or any(name not in debs for name in FIXED_PACKAGES):
        (lists_dir / "partial").mkdir(parents=True, exist_ok=True)
        log.info("prepare: the package lists could not give %s; fetching them afresh into %s",
                 ", ".join(sorted(set(FIXED_PACKAGES) - set(debs))) or "a python3.N-doc",
                 lists_dir)
        update = _run(["apt-get", *private, "update"])
        if update.returncode != 0:
            update_error = (update.stderr.strip().splitlines() or [f"exit {update.returncode}"])
            update_error = update_error[-1][-300:]
            # Said once: in the error (or auto's one warning) when nothing could be had.
            (log.warning if debs else log.info)("prepare: apt-get update failed: %s",
                                                update_error)
        else:
            fresh = {name: version for name, version in demo_packages(private).items()
                     if name not in debs
                     and not (has_python_doc and name in _PYTHON_DOC_CANDIDATES)}
            debs.update(download_packages(fresh, cache_dir, private))
    if not debs:
        cause = f" (apt-get update: {update_error})" if update_error else ""
        raise DemoSourceUnavailable(
            f"prepare --demo: none of the demo packages (python3.N-doc, "
            f"{', '.join(FIXED_PACKAGES)}) could be downloaded with apt-get{cause}; it needs "
            f"network access to Debian's or Ubuntu's archive (--demo-source python needs none)",
            why=f"none of the demo packages could be downloaded from the archive{cause}")
    if not any(name in debs for name in _PYTHON_DOC_CANDIDATES):
        log.warning("prepare: no python3.N-doc package could be downloaded; skipping it")
    for name in FIXED_PACKAGES:
        if name not in debs:
            log.warning("prepare: package %s could not be downloaded; skipping it", name)
    return debs


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # a few old fortune/dictionary files are Latin-1
        return data.decode("latin-1")


def _dictd_number(text: str) -> int:
    value = 0
    for ch in text:
        value = value * 64 + _DICTD_DIGITS.index(ch)
    return value


def _dictd_entries(root: Path) -> Iterator[tuple[str, str]]:
    for index in sorted(root.glob("usr/share/dictd/*.index")):
        body = index.with_suffix(".dict.dz")
        if not body.is_file():
            log.warning("prepare: %s has no matching .dict.dz; skipping it", index.name)
            continue
        data = gzip.decompress(body.read_bytes())  # dictzip is gzip-compatible
        seen: set[tuple[int, int]] = set()
        for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) < 3 or parts[0].startswith(("00-database", "00database")):
                continue  # metadata entries, not dictionary text
            span = (_dictd_number(parts[1]), _dictd_number(parts[2]))
            if span in seen:  # several headwords may point at one entry
                continue
            seen.add(span)
            yield f"{index.stem}:{parts[0]}", _decode(data[span[0]:span[0] + span[1]])


def _fortunes(root: Path) -> Iterator[tuple[str, str]]:
    for path in sorted(root.glob("usr/share/games/fortunes/*")):
        if path.is_symlink() or not path.is_file() or path.suffix in (".dat", ".u8"):
            continue
        entries = re.split(r"^%\s*$", _decode(path.read_bytes()), flags=re.M)
        for i, entry in enumerate(entries):
            yield f"{path.name}:{i}", entry.strip("\n")


def _whole_files(*patterns: str, gz: bool = False):
    def extract(root: Path) -> Iterator[tuple[str, str]]:
        seen: set[Path] = set()  # a pattern may reach one file through two directories
        for pattern in patterns:
            for path in sorted(root.glob(pattern)):
                if path.is_file() and not path.is_symlink() and path.resolve() not in seen:
                    seen.add(path.resolve())
                    data = path.read_bytes()
                    yield str(path.relative_to(root)), _decode(gzip.decompress(data) if gz
                                                               else data)
    return extract


def extractor_for(package: str):
    if package.startswith("python3") and package.endswith("-doc"):
        return _whole_files("usr/share/doc/python3*/html/_sources/**/*.rst.txt")
    return {
        "perl-doc": _whole_files("usr/share/perl/5.*/pod/*.pod"),
        "dict-jargon": _dictd_entries, "dict-foldoc": _dictd_entries,
        "dict-devil": _dictd_entries,
        "fortunes": _fortunes, "fortunes-min": _fortunes,
        "gnu-standards": _whole_files("usr/share/doc/gnu-standards/*.text.gz", gz=True),
        "debian-reference-en": _whole_files("usr/share/debian-reference/*.txt.gz",
                                            "usr/share/doc/debian-reference-en/**/*.txt.gz",
                                            gz=True),
    }[package]


def iter_demo_documents(debs: dict[str, tuple[Path, str]],
                        position: list | None = None) -> Iterator[tuple[dict, list]]:
    """Unpack each ``.deb`` into a temporary directory and yield its documents as
    ``({"text", "source", "id"}, [package index, documents of it so far])``; from ``position``
    on (one it yielded before), skipping the packages before it unpacked."""
    first, skip = position or (0, 0)
    for index, (package, (deb, _version)) in enumerate(debs.items()):
        if index < first:
            continue
        with tempfile.TemporaryDirectory(prefix="tape-demo-") as tmp:
            out = _run(["dpkg-deb", "-x", str(deb), tmp])
            if out.returncode != 0:
                log.warning("prepare: dpkg-deb -x %s failed: %s; skipping it", deb.name,
                            out.stderr.strip()[-300:])
                continue
            n = 0
            for doc_id, text in extractor_for(package)(Path(tmp)):
                n += 1
                if index > first or n > skip:
                    yield {"text": text, "source": package, "id": doc_id}, [index, n]
            log.info("prepare: %s: %d documents", package, n)
            if n == 0:
                log.warning("prepare: %s yielded no documents (layout changed?)", package)
