"""What every resumable loader's state shares: its format version, config fingerprints, and
how a saved state differs from the data a loader would read now.

A state carries ``fingerprint`` (a digest of ``fingerprint_fields``: sources, tokenizer,
seq_len, seed, packing options, …) and, since states name what changed,
``fingerprint_inputs``: per source its config key, name, digest and file list (name and size,
or token shard and token count; at most ``LISTED_FILES`` per source), the tokenizer's path and
the packing options one by one. A source of local raw files also records a content sample
of each file (``content``: ``formats.content_sample``, beside ``files``; ``content_rule``;
``content_digest`` when every file was read), so that a file edited in place at the same
size is noticed too. The inputs are not part of the fingerprint (states saved before them
keep their fingerprint and resume as before; their mismatches are only described less
precisely, and a state without content samples is compared on names and sizes only).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

STATE_VERSION = 1
# Files of one source a state lists by name (beyond: their count and digest only, so that the
# per-rank state of a corpus of many thousand files stays small).
LISTED_FILES = 1000
# Changes of one kind named in a message before "and N more".
_NAMED = 3
# Packing options added after states were first saved, at the value that reproduces what a
# state without them did: left out of a fingerprint at that value (so that older states keep
# theirs), and read as that value where a state lacks them.
LATER_PACKING_OPTIONS = {"data.block_shuffle_window": 1}


def digest(obj: object) -> str:
    """A short, stable fingerprint of a JSON-able object (16 hex digits of its sha256)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def packing_options(options: dict) -> dict:
    """``options`` (``{"data.<key>": value}``) less the ``LATER_PACKING_OPTIONS`` at the value
    that reproduces the older stream."""
    return {k: v for k, v in options.items()
            if k not in LATER_PACKING_OPTIONS or v != LATER_PACKING_OPTIONS[k]}


def source_inputs(source, files: list[list], unit: str, settings: dict,
                  content: list | None = None, content_rule: str | None = None) -> dict:
    """What a state records of one source: ``files`` are its files' identities
    ``[name, amount, ...]`` (``amount`` in ``unit``: bytes or tokens), ``settings`` the source's
    keys that enter its digest besides them (``{"weight": 1.0, ...}``), ``content`` a content
    sample per file (``None`` for a file not read) or ``None`` (not sampled: Hub sources,
    token shards), taken by ``content_rule`` (samples by another rule are not compared). The
    content does not enter ``digest`` (older states compare as before)."""
    files_digest = digest(files)
    entry = {"key": source.key, "name": source.name, "unit": unit, "settings": dict(settings),
             "digest": digest([settings, files_digest]), "files_digest": files_digest,
             "count": len(files)}
    if len(files) <= LISTED_FILES:
        entry["files"] = [list(f) for f in files]
    if content is not None:
        entry["content_rule"] = content_rule
        if None not in content:  # a file not read now: compared one by one only
            entry["content_digest"] = digest(content)
        if len(files) <= LISTED_FILES:
            entry["content"] = list(content)
    return entry


def state_differences(state: dict, fields: dict, inputs: dict) -> list[str]:
    """How the data described by ``fields`` (a loader's ``fingerprint_fields``) and ``inputs``
    (its ``fingerprint_inputs``) differs from what ``state`` was saved with: one
    ``"<field> (<what changed>)"`` per differing field; empty when they match.

    A field that is ``None`` in ``fields`` is unknown here (the files of a Hub source are
    listed only online): it is not compared, except that the sources that are known (local
    files) are compared one by one when the state lists them."""
    unknown = [k for k, v in fields.items() if v is None]
    saved_inputs = state.get("fingerprint_inputs")
    saved_inputs = saved_inputs if isinstance(saved_inputs, dict) else {}
    if not unknown and state.get("fingerprint") == digest(fields):
        # Same names and sizes: only a file's content (where both sides sampled it) can differ.
        changes = _source_changes(saved_inputs.get("sources"), inputs.get("sources"))
        return [f"sources ({'; '.join(changes)})"] if changes else []
    saved = state.get("fingerprint_fields")
    saved = saved if isinstance(saved, dict) else {}
    parts = []
    for key in list(fields) + [k for k in saved if k not in fields]:
        now, then = fields.get(key), saved.get(key)
        if key == "sources" and (key in unknown or now == then):
            changes = _source_changes(saved_inputs.get("sources"), inputs.get("sources"))
            if changes:
                parts.append(f"sources ({'; '.join(changes)})")
            continue
        if key in unknown:
            continue
        if now != then:
            parts.append(f"{key} ({_describe(key, then, now, saved_inputs, inputs)})")
    if not parts and not unknown:
        parts.append(f"fingerprint (saved {state.get('fingerprint')!r}, now {digest(fields)!r})")
    return parts


def _describe(key: str, then, now, saved_inputs: dict, inputs: dict) -> str:
    generic = f"saved {then!r}, now {now!r}"
    if key == "sources":
        changes = _source_changes(saved_inputs.get("sources"), inputs.get("sources"))
        return "; ".join(changes) if changes else generic
    if key == "tokenizer" and isinstance(then, str) and isinstance(now, str):
        path = inputs.get("tokenizer")
        what = f"data.tokenizer {path}" if path else "data.tokenizer"
        return f"{what} is not the tokenizer of the checkpoint: sha256 {then[:12]}… then, " \
               f"{now[:12]}… now"
    if key == "packing":
        before, after = saved_inputs.get("packing"), inputs.get("packing")
        if isinstance(before, dict) and isinstance(after, dict):
            values = [(k, before.get(k, LATER_PACKING_OPTIONS.get(k)),
                       after.get(k, LATER_PACKING_OPTIONS.get(k)))
                      for k in list(after) + [k for k in before if k not in after]]
            changed = [f"{k}: saved {old!r}, now {new!r}" for k, old, new in values
                       if old != new]
            if changed:
                return "; ".join(changed)
    return generic


def _source_changes(saved: object, now: object) -> list[str]:
    """Which sources changed and how (their settings, files added, removed, resized,
    re-ordered or edited at the same size); empty when the state does not list its sources
    (saved before it did)."""
    if not isinstance(saved, list) or not isinstance(now, list):
        return []
    def names(entries: list) -> str:
        return ", ".join(str(e.get("name")) if isinstance(e, dict) else "a Hub source"
                         for e in entries)

    out = []
    if len(saved) != len(now):
        out.append(f"data.sources: {len(saved)} source(s) then ({names(saved)}), {len(now)} "
                   f"now ({names(now)})")
    for then, current in zip(saved, now):
        if current is None or not isinstance(then, dict):
            continue  # unknown here (a Hub source)
        edited = _content_changes(then, current)
        if then.get("digest") == current.get("digest") and not edited:
            continue  # unchanged
        renamed = f"; saved as {then.get('name')}" if then.get("name") != current["name"] else ""
        label = f"{current['key']} ({current['name']}{renamed})"
        before = then.get("settings") or {}
        what = [f"{k}: saved {before.get(k)!r}, now {v!r}"
                for k, v in current["settings"].items() if before.get(k) != v]
        what += _file_changes(then, current) + edited
        out.append(f"{label}: {', '.join(what) or 'its files differ'}")
    return out


def _file_changes(then: dict, now: dict) -> list[str]:
    if then.get("files_digest") == now.get("files_digest"):
        return []
    unit = now.get("unit", "bytes")
    before, after = then.get("files"), now.get("files")
    if not isinstance(before, list) or not isinstance(after, list):
        if then.get("count") != now.get("count"):
            return [f"{then.get('count')} file(s) then, {now.get('count')} now (more than "
                    f"{LISTED_FILES}: not named in the checkpoint)"]
        return [f"its {now.get('count')} files differ in names or sizes (more than "
                f"{LISTED_FILES}: not named in the checkpoint)"]
    before, after = [tuple(f) for f in before], [tuple(f) for f in after]
    gone, new = Counter(before) - Counter(after), Counter(after) - Counter(before)
    gone_names = {f[0] for f in gone}
    new_names = {f[0] for f in new}
    changed, seen = [], set()
    for f in before:
        if f in gone and f[0] in new_names and f[0] not in seen:
            seen.add(f[0])
            replacement = next(g for g in after if g in new and g[0] == f[0])
            if f[1] != replacement[1]:
                changed.append(f"{f[0]} changed ({f[1]} -> {replacement[1]} {unit})")
            else:
                changed.append(f"{f[0]} changed (same {f[1]} {unit}, other content)")
    removed = _unique(f[0] for f in before if f in gone and f[0] not in new_names)
    added = _unique(f[0] for f in after if f in new and f[0] not in gone_names)
    items = changed + [f"{name} removed" for name in removed] + [f"{name} added"
                                                                 for name in added]
    if not items and before != after:
        return ["the same files in another order"]
    more = f" and {len(items) - _NAMED} more change(s)" if len(items) > _NAMED else ""
    return [", ".join(items[:_NAMED]) + more] if items else []


def _content_changes(then: dict, now: dict) -> list[str]:
    """The files of a source whose content sample differs at the same name and size; empty
    where either side has no samples (a state saved before them, a Hub source, token shards)
    or a file could not be read, or the samples were taken by another rule."""
    before, after = then.get("content_digest"), now.get("content_digest")
    if (before is not None and before == after) \
            or then.get("content_rule") != now.get("content_rule"):
        return []
    files = (then.get("files"), now.get("files"), then.get("content"), now.get("content"))
    if not all(isinstance(f, list) for f in files) or len(files[0]) != len(files[2]) \
            or len(files[1]) != len(files[3]):
        if before is None or after is None or then.get("files_digest") != now.get("files_digest"):
            return []  # not sampled, or names or sizes differ: told by _file_changes
        return [f"the content of some of its {now.get('count')} files changed at the same "
                f"sizes (more than {LISTED_FILES}: not named in the checkpoint)"]
    unit = now.get("unit", "bytes")
    remaining: dict[tuple, list] = {}
    for identity, sample in zip(files[1], files[3]):
        remaining.setdefault(tuple(identity), []).append(sample)
    items = []
    for identity, sample in zip(files[0], files[2]):
        pending = remaining.get(tuple(identity))
        if not pending:
            continue  # removed or resized: told by _file_changes
        current = pending.pop(0)
        if sample is not None and current is not None and sample != current:
            items.append(f"{identity[0]} changed (same {identity[1]} {unit}, other content)")
    more = f" and {len(items) - _NAMED} more change(s)" if len(items) > _NAMED else ""
    return [", ".join(items[:_NAMED]) + more] if items else []


def _unique(names) -> list:
    out = []
    for name in names:
        if name not in out:
            out.append(name)
    return out


def recorded_tokenizer(state) -> str | None:
    """The sha256 of the sentencepiece model a saved loader ``state`` read its data with
    (``fingerprint_fields["tokenizer"]`` of a text or token loader); ``None`` where the state
    does not say (no state, an older or synthetic one)."""
    fields = state.get("fingerprint_fields") if isinstance(state, dict) else None
    sha = fields.get("tokenizer") if isinstance(fields, dict) else None
    if isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha):
        return sha
    return None
