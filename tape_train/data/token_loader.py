"""The training loader of pre-tokenised corpora (``data.format: tokens``).

One global sequence of samples, independent of the number of ranks: sample ``i`` is block
``perm_e(i mod N)`` of epoch ``e = i // N`` (``tokens.TokenBlocks``, ``feistel_permutation``
keyed by the train seed and the epoch; identity order with ``data.shuffle: false``). Each call
of ``next()`` on every data-parallel rank together consumes the next ``dp_size × b`` samples:
rank ``r`` takes samples ``c + r·b … c + r·b + b - 1`` where ``c`` is the global count
consumed so far. The state is that one integer ``c`` (identical on every rank), so resuming is
O(1) — no data is re-read — and a run stopped on ``n`` ranks continues the same global sample
sequence on ``n'`` ranks.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from tape_train.data.config import DataConfig, DataError
from tape_train.data.state import STATE_VERSION
from tape_train.data.state import digest as _digest
from tape_train.data.tokens import TokenBlocks, feistel_permutation

log = logging.getLogger("tape_train.data")

_EPOCH_TAG = 0x544B


def token_directories(cfg: DataConfig) -> list[tuple[Path, str]]:
    """``(directory, config key)`` of every training source, which must each be one prepared,
    tokenised directory (a Hub source or plain files are errors naming the key)."""
    out = []
    weights = {s.weight for s in cfg.sources}
    if len(weights) > 1:
        raise DataError("data.format=tokens concatenates its sources into one stream; source "
                        f"weights {sorted(weights)} are not supported (prepare the inputs "
                        f"together with `tape-data prepare --input A B --tokenize`)")
    for source in cfg.sources:
        key = f"{source.key}.path"
        if source.hub is not None or len(source.paths) != 1:
            raise DataError(f"{source.key}: data.format=tokens needs a single prepared "
                            f"directory per source (from `tape-data prepare --tokenize`), "
                            f"got {source.hub or source.path!r}")
        out.append((Path(source.paths[0]), key))
    return out


class TokenLoader:
    """Endless ``{"input_ids": (b, L) int64, "labels": (b, L) int64}`` batches read from token
    shards by global sample index. Same interface as ``loader.TrainLoader``."""

    def __init__(self, cfg: DataConfig, tokenizer, seq_len: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int):
        self.cfg = cfg
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = int(seed)
        directories = token_directories(cfg)
        self.blocks = TokenBlocks(directories, seq_len + 1)
        for (directory, key), manifest in zip(directories, self.blocks.manifests):
            if manifest["tokenizer_sha256"] != tokenizer.sha256:
                raise DataError(f"{key}: {directory} was tokenised with tokenizer "
                                f"{manifest['tokenizer']!r} (sha256 "
                                f"{manifest['tokenizer_sha256'][:12]}…), but data.tokenizer is "
                                f"{tokenizer.path!r} (sha256 {tokenizer.sha256[:12]}…)")
            if (manifest["add_bos"], manifest["add_eos"]) != (cfg.add_bos, cfg.add_eos):
                raise DataError(f"{key}: {directory} was tokenised with add_bos="
                                f"{manifest['add_bos']}, add_eos={manifest['add_eos']}, but "
                                f"data.add_bos={cfg.add_bos}, data.add_eos={cfg.add_eos}")
        self.fingerprint_fields = {
            "sources": _digest([[s["path"], s["tokens"], s["sha256"]]
                                for m in self.blocks.manifests for s in m["shards"]]),
            "tokenizer": tokenizer.sha256,
            "seq_len": seq_len,
            "seed": self.seed,
            "packing": _digest(["tokens", cfg.add_bos, cfg.add_eos, cfg.shuffle]),
        }
        self.fingerprint = _digest(self.fingerprint_fields)
        self.samples = 0  # global samples consumed by all ranks together
        self.batches_received = 0
        self.wait_seconds = 0.0
        self.tokens_read = 0

    # -- order --------------------------------------------------------------------------------
    def block_of(self, samples: np.ndarray) -> np.ndarray:
        """Block index of each global sample index."""
        n = self.blocks.num_blocks
        samples = np.asarray(samples, dtype=np.int64)
        epochs, within = samples // n, samples % n
        if not self.cfg.shuffle:
            return within
        out = np.empty_like(within)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = feistel_permutation(within[sel], n, [self.seed, _EPOCH_TAG, int(epoch)])
        return out

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "format": "tokens", "fingerprint": self.fingerprint,
                "fingerprint_fields": dict(self.fingerprint_fields), "dp_rank": self.dp_rank,
                "dp_size": self.dp_size, "position": {"samples": self.samples},
                "batches_received": self.batches_received}

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
            differing = [k for k in self.fingerprint_fields
                         if saved.get(k) != self.fingerprint_fields[k]] or ["fingerprint"]
            problem = "data fingerprint differs in " + ", ".join(
                f"{k} (saved {saved.get(k)!r}, now {self.fingerprint_fields.get(k)!r})"
                for k in differing)
            if not allow_mismatch:
                raise DataError(f"cannot resume the data loader: {problem}. Pass "
                                f"allow_mismatch=True to resume from the saved position anyway")
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
        blocks = self.block_of(np.arange(first, first + b))
        array = np.stack([self.blocks.read(int(k)) for k in blocks])
        self.samples += self.dp_size * b
        self.batches_received += 1
        self.tokens_read += array.size
        batch = {"input_ids": torch.from_numpy(array[:, :-1].copy()),
                 "labels": torch.from_numpy(array[:, 1:].copy())}
        self.wait_seconds += time.perf_counter() - started
        return batch

    def close(self) -> None:
        self.blocks.close()

    def __del__(self) -> None:
        try:
            self.blocks.close()
        except Exception:  # interpreter shutdown
            pass

    @property
    def epochs(self) -> list[int]:
        """Epoch of the next global sample (one entry: the sources form one stream)."""
        return [self.samples // self.blocks.num_blocks]

    @property
    def stats(self) -> dict:
        return {"batches_received": self.batches_received, "documents_tokenized": 0,
                "tokens_read": self.tokens_read, "skipped": {},
                "wait_seconds": self.wait_seconds}
