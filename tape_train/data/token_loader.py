"""The training loader of pre-tokenised corpora (``data.format: tokens``).

One global sequence of samples, independent of the number of ranks. Each source (one prepared
directory, or a list of them concatenated) is cut into ``N_s`` fixed blocks; its sample ``j``
is block ``perm_{s,e}(j mod N_s)`` of its own epoch ``e = j // N_s`` (``tokens.TokenBlocks``,
``feistel_permutation`` keyed by the train seed, the source and the epoch; identity order with
``data.shuffle: false``). With one source global sample ``i`` is that source's sample ``i``;
with several, ``token_mixture.SampleMixture`` says which source global sample ``i`` comes from
and which of its samples it is, with exact long-run shares equal to the normalised
``data.sources[i].weight``. Each call of ``next()`` on every data-parallel rank together
consumes the next ``dp_size × b`` samples: rank ``r`` takes samples ``c + r·b … c + r·b + b -
1`` where ``c`` is the global count consumed so far. The state is that one integer ``c``
(identical on every rank), so resuming is O(1) — no data is re-read — and a run stopped on
``n`` ranks continues the same global sample sequence on ``n'`` ranks.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from tape_train.data.config import DataConfig, DataError
from tape_train.data.state import STATE_VERSION, source_inputs, state_differences
from tape_train.data.state import digest as _digest
from tape_train.data.token_mixture import MIXTURE_BLOCK, SampleMixture, integer_weights
from tape_train.data.tokens import TokenBlocks, feistel_permutation

log = logging.getLogger("tape_train.data")

_EPOCH_TAG = 0x544B


def token_directories(cfg: DataConfig) -> list[list[tuple[Path, str]]]:
    """Per training source, ``(directory, config key)`` of each of its prepared, tokenised
    directories (a ``path`` list is concatenated into one source; a Hub source is an error
    naming its key)."""
    out = []
    for source in cfg.sources:
        if source.hub is not None:
            raise DataError(f"{source.key}: data.format=tokens needs prepared directories (from "
                            f"`tape-data prepare --tokenize`), got hub {source.hub!r}")
        paths = source.paths
        keys = [f"{source.key}.path"] if len(paths) == 1 else [
            f"{source.key}.path[{i}]" for i in range(len(paths))]
        out.append([(Path(p), key) for p, key in zip(paths, keys)])
    return out


def open_token_sources(cfg: DataConfig, tokenizer, seq_len: int) -> list[TokenBlocks]:
    """The ``seq_len + 1``-token blocks of every source, checked against ``tokenizer`` (by
    sha256) and the BOS/EOS convention of ``cfg``."""
    sources = []
    for source, directories in zip(cfg.sources, token_directories(cfg)):
        blocks = TokenBlocks(directories, seq_len + 1, name=source.key)
        for (directory, key), manifest in zip(directories, blocks.manifests):
            if manifest["tokenizer_sha256"] != tokenizer.sha256:
                raise DataError(f"{key}: {directory} was tokenised with tokenizer "
                                f"{manifest['tokenizer']!r} (sha256 "
                                f"{manifest['tokenizer_sha256'][:12]}…), but data.tokenizer is "
                                f"{tokenizer.path!r} (sha256 {tokenizer.sha256[:12]}…)")
            if (manifest["add_bos"], manifest["add_eos"]) != (cfg.add_bos, cfg.add_eos):
                raise DataError(f"{key}: {directory} was tokenised with add_bos="
                                f"{manifest['add_bos']}, add_eos={manifest['add_eos']}, but "
                                f"data.add_bos={cfg.add_bos}, data.add_eos={cfg.add_eos}")
        sources.append(blocks)
    return sources


def token_mixture(cfg: DataConfig, seed: int) -> SampleMixture | None:
    """The weighted mixture of several sources (``None`` for one: its weight has no effect).
    Every source needs a share of at least ``1/MIXTURE_BLOCK``."""
    if len(cfg.sources) == 1:
        return None
    weights = integer_weights([s.weight for s in cfg.sources])
    total = sum(weights)
    for source, weight in zip(cfg.sources, weights):
        if weight * MIXTURE_BLOCK < total:
            raise DataError(f"{source.key}.weight: {source.weight:g} gives a share of "
                            f"{weight / total:.3g} of the samples, below the 1/{MIXTURE_BLOCK} "
                            f"that data.format=tokens needs per source (raise it, or drop the "
                            f"source)")
    return SampleMixture(weights, seed, cfg.shuffle)


def token_fingerprint(cfg: DataConfig, sources: list[TokenBlocks], tokenizer, seq_len: int,
                      seed: int, mixture: SampleMixture | None) -> tuple[dict, dict]:
    """``(fingerprint_fields, fingerprint_inputs)`` of a ``data.format: tokens`` loader over
    ``sources`` (``open_token_sources``): from the manifests alone (shard names, token counts,
    sha256), no token is read."""
    shards = [[[s["path"], s["tokens"], s["sha256"]] for m in source.manifests
               for s in m["shards"]] for source in sources]
    fields = {
        "sources": _digest([shard for listed in shards for shard in listed]),
        "tokenizer": tokenizer.sha256,
        "seq_len": seq_len,
        "seed": int(seed),
        "packing": _digest(["tokens", cfg.add_bos, cfg.add_eos, cfg.shuffle]),
    }
    if mixture is not None:  # one source keeps the fields (and stream) it always had
        fields["mixture"] = {"weights": mixture.ratio(), "block": mixture.block,
                             "shards": [len(source.paths) for source in sources]}
    listed = []
    for config, source in zip(cfg.sources, sources):
        several = len(source.manifests) > 1  # a `path` list: name the directory of a shard
        listed.append(source_inputs(config, [
            [f"path[{i}]/{s['path']}" if several else s["path"], s["tokens"], s["sha256"][:16]]
            for i, m in enumerate(source.manifests) for s in m["shards"]], "tokens", {}))
    inputs = {"sources": listed, "tokenizer": getattr(tokenizer, "path", None),
              "packing": {"data.add_bos": cfg.add_bos, "data.add_eos": cfg.add_eos,
                          "data.shuffle": cfg.shuffle}}
    return fields, inputs


class TokenLoader:
    """Endless ``{"input_ids": (b, L) int64, "labels": (b, L) int64}`` batches read from token
    shards by global sample index. Same interface as ``loader.TrainLoader``."""

    def __init__(self, cfg: DataConfig, tokenizer, seq_len: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int):
        self.cfg = cfg
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = int(seed)
        self.sources = open_token_sources(cfg, tokenizer, seq_len)
        self.mixture = token_mixture(cfg, self.seed)
        self.fingerprint_fields, self.fingerprint_inputs = token_fingerprint(
            cfg, self.sources, tokenizer, seq_len, self.seed, self.mixture)
        if self.mixture is not None:
            log.info("data: token mixture %s: %s", self.mixture.ratio(), "; ".join(
                f"{c.key}: {b.num_blocks} blocks, {w / self.mixture.total:.1%} of the samples"
                for c, b, w in zip(cfg.sources, self.sources, self.mixture.weights)))
        self.fingerprint = _digest(self.fingerprint_fields)
        self.samples = 0  # global samples consumed by all ranks together
        self.batches_received = 0
        self.wait_seconds = 0.0
        self.tokens_read = 0

    # -- order --------------------------------------------------------------------------------
    def locate(self, samples) -> tuple[np.ndarray, np.ndarray]:
        """``(source, block within the source)`` of each global sample index."""
        samples = np.asarray(samples, dtype=np.int64).reshape(-1)
        if self.mixture is None:
            sources, indices = np.zeros_like(samples), samples
        else:
            sources, indices = self.mixture.locate(samples)
        blocks = np.empty_like(indices)
        for source in np.unique(sources):
            sel = sources == source
            blocks[sel] = self._permute(int(source), indices[sel])
        return sources, blocks

    def _permute(self, source: int, indices: np.ndarray) -> np.ndarray:
        """Block of each of ``source``'s sample indices: ``perm_{source,e}(j mod N)``."""
        n = self.sources[source].num_blocks
        epochs, within = indices // n, indices % n
        if not self.cfg.shuffle:
            return within
        out = np.empty_like(within)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            key = [self.seed, _EPOCH_TAG, int(epoch)] + ([source] if self.mixture else [])
            out[sel] = feistel_permutation(within[sel], n, key)
        return out

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "format": "tokens", "fingerprint": self.fingerprint,
                "fingerprint_fields": dict(self.fingerprint_fields), "dp_rank": self.dp_rank,
                "dp_size": self.dp_size, "position": {"samples": self.samples},
                "batches_received": self.batches_received,
                "fingerprint_inputs": json.loads(json.dumps(self.fingerprint_inputs))}

    def load_state_dict(self, state: dict, allow_mismatch: bool = False) -> None:
        """Continue at the saved global sample index; any dp_size may resume any state."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError(f"loader state: unsupported or missing version (expected "
                            f"{STATE_VERSION})")
        if state.get("format") != "tokens":
            raise DataError("loader state was saved by a data.format=text loader; it cannot "
                            "resume a data.format=tokens run (different streams)")
        if state.get("fingerprint") != self.fingerprint:
            saved = state.get("fingerprint_fields", {})
            differing = state_differences(state, self.fingerprint_fields,
                                          self.fingerprint_inputs)
            problem = "data fingerprint differs in " + ", ".join(differing)
            if any(part.startswith("mixture (") for part in differing) \
                    and "mixture" not in saved:
                problem += (" (the state was saved by a loader that concatenated all sources "
                            "into one stream; to continue that stream, list their directories "
                            "in order as one source, `path: [A, B, ...]`, and resume with "
                            "tape-train --allow-config-change, as data.sources changes)")
            if not allow_mismatch:
                raise DataError(f"cannot resume the data loader: {problem}. Pass "
                                f"allow_mismatch=True (tape-train: --allow-config-change) to "
                                f"resume from the saved position anyway")
            log.warning("data: resuming despite mismatch (allow_mismatch=True): %s", problem)
        try:
            samples = int(state["position"]["samples"])
            if samples < 0:
                raise ValueError(samples)
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"loader state: bad position {state.get('position')!r} "
                            f"({type(exc).__name__})") from None
        if state.get("dp_size") != self.dp_size:
            log.info("data: resuming the global token stream at sample %d on %d rank(s) "
                     "(saved on %s)", samples, self.dp_size, state.get("dp_size"))
        self.samples = samples
        self.batches_received = int(state.get("batches_received", 0))

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> "TokenLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        started = time.perf_counter()
        b = self.micro_batch_size
        first = self.samples + self.dp_rank * b
        sources, blocks = self.locate(np.arange(first, first + b))
        array = np.stack([self.sources[s].read(int(k)) for s, k in zip(sources, blocks)])
        self.samples += self.dp_size * b
        self.batches_received += 1
        self.tokens_read += array.size
        batch = {"input_ids": torch.from_numpy(array[:, :-1].copy()),
                 "labels": torch.from_numpy(array[:, 1:].copy())}
        self.wait_seconds += time.perf_counter() - started
        return batch

    def close(self) -> None:
        for source in self.sources:
            source.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a constructor that failed early
            pass

    @property
    def epochs(self) -> list[int]:
        """Per source, the epoch of its next sample (for logging)."""
        counts = [self.samples] if self.mixture is None else self.mixture.counts(self.samples)
        return [n // source.num_blocks for n, source in zip(counts, self.sources)]

    @property
    def stats(self) -> dict:
        return {"batches_received": self.batches_received, "documents_tokenized": 0,
                "tokens_read": self.tokens_read, "skipped": {},
                "wait_seconds": self.wait_seconds}
