"""Offline cache of TrainingExamples: safetensors shards + an index JSON with sha256 per shard.

Layout of a cache directory:
    index.json                    {"version": 1, "meta": {...}, "layout": {...}, "shards": {"<i>":
                                   {"file", "sha256", "bytes", "rows"}}}  (rewritten atomically
                                   after every shard; layout = data fingerprint + shard size)
    shard-000000.safetensors      rows [0, R) stacked: input_ids [R, N] int64, document_ids [R, N]
                                  int32, loss_mask [R, N] bool, hidden [R, N, n_aux*H],
                                  last_hidden [R, N, H]
Every file is written to a temporary name and renamed into place, so an interrupted run leaves
either a complete shard or none; a shard not (yet) in the index is regenerated. Reads verify the
recorded sha256 and raise DataError on mismatch. One writer at a time per directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile

import torch

from . import hidden_states
from .records import DataError, PackedSequence, TrainingExample
from .shift import eagle_shift

INDEX = "index.json"
_FIELDS = ("input_ids", "document_ids", "loss_mask", "hidden", "last_hidden")


def _atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def packed_fingerprint(packed_rows) -> str:
    """sha256 over the packed rows' tokens, documents and masks: identifies the data a cache holds."""
    h = hashlib.sha256()
    for p in packed_rows:
        for t in (p.input_ids, p.document_ids, p.loss_mask):
            h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


class HiddenStateCache:
    """Resumable on-disk store of TrainingExamples (see the module docstring for the layout).

    meta: JSON-able settings the cached tensors depend on (verifier, aux_layer_ids, seq_len, ...).
    Opening an existing cache with different meta raises DataError instead of mixing data.
    """

    def __init__(self, directory: str | os.PathLike, *, meta: dict | None = None):
        self.dir = pathlib.Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        index_path = self.dir / INDEX
        if index_path.is_file():
            try:
                self.index = json.loads(index_path.read_text())
            except json.JSONDecodeError as e:
                raise DataError(f"cache index {index_path} is corrupted: {e}") from None
            if not isinstance(self.index, dict) or self.index.get("version") != 1:
                raise DataError(f"cache index {index_path} has an unknown format")
            if meta is not None and self.index.get("meta") != _jsonable(meta):
                raise DataError(
                    f"cache {self.dir} was built with different settings:\n  cached: "
                    f"{self.index.get('meta')}\n  wanted: {_jsonable(meta)}\nuse another directory "
                    "or delete this one"
                )
        else:
            self.index = {"version": 1, "meta": _jsonable(meta or {}), "shards": {}}
            self._save_index()

    @property
    def meta(self) -> dict:
        return self.index["meta"]

    def _save_index(self) -> None:
        _atomic_write_bytes(self.dir / INDEX, json.dumps(self.index, indent=1, sort_keys=True).encode())

    def shard_path(self, i: int) -> pathlib.Path:
        return self.dir / f"shard-{i:06d}.safetensors"

    @property
    def shard_ids(self) -> list[int]:
        return sorted(int(k) for k in self.index["shards"])

    @property
    def num_shards(self) -> int:
        return len(self.index["shards"])

    def __len__(self) -> int:
        return sum(int(s["rows"]) for s in self.index["shards"].values())

    def has_shard(self, i: int) -> bool:
        """Recorded in the index and present with the recorded size (the hash is checked on read)."""
        rec = self.index["shards"].get(str(i))
        if rec is None:
            return False
        p = self.dir / rec["file"]
        return p.is_file() and p.stat().st_size == rec["bytes"]

    def write_shard(self, i: int, examples: list[TrainingExample]) -> None:
        from safetensors.torch import save

        if not examples:
            raise ValueError("examples must not be empty")
        try:
            tensors = {f: torch.stack([getattr(e, f).detach().cpu() for e in examples]).contiguous() for f in _FIELDS}
        except RuntimeError as e:
            raise ValueError(f"examples of one shard must have equal shapes: {e}") from None
        data = save(tensors, metadata={"rows": str(len(examples))})
        path = self.shard_path(i)
        _atomic_write_bytes(path, data)
        self.index["shards"][str(i)] = {
            "file": path.name,
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "rows": len(examples),
        }
        self._save_index()

    def read_shard(self, i: int, *, verify: bool = True) -> list[TrainingExample]:
        from safetensors.torch import load

        rec = self.index["shards"].get(str(i))
        if rec is None:
            raise KeyError(f"shard {i} is not in cache {self.dir}")
        path = self.dir / rec["file"]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"cache shard {path} is missing (listed in {INDEX})") from None
        if verify and hashlib.sha256(data).hexdigest() != rec["sha256"]:
            raise DataError(
                f"cache shard {path} is corrupted (sha256 mismatch with {INDEX}); "
                "delete it and regenerate (generate() skips only intact shards)"
            )
        try:
            t = load(data)
        except Exception as e:  # safetensors raises its own error types
            raise DataError(f"cache shard {path} cannot be parsed: {e}") from None
        return [TrainingExample(**{f: t[f][r] for f in _FIELDS}) for r in range(t["input_ids"].shape[0])]

    def __iter__(self):
        for i in self.shard_ids:
            yield from self.read_shard(i)

    def generate(
        self,
        verifier,
        packed_rows: list[PackedSequence],
        aux_layer_ids,
        *,
        rows_per_shard: int = 16,
        dtype: torch.dtype | None = None,
        progress: bool = False,
    ) -> int:
        """Compute (verifier_hidden_states + eagle_shift) for every packed row and store it, shard i
        holding rows [i*R, (i+1)*R). Shards already present are skipped (resume). The data
        fingerprint, aux ids and shard size are recorded in meta and must match on resume.
        dtype: storage dtype of hidden/last_hidden (default: the verifier's). Returns the shard count."""

        if isinstance(rows_per_shard, bool) or not isinstance(rows_per_shard, int) or rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be a positive int, got {rows_per_shard!r}")
        if not packed_rows:
            raise DataError("packed_rows is empty: nothing to cache")
        layout = {
            "data_sha256": packed_fingerprint(packed_rows),
            "rows": len(packed_rows),
            "rows_per_shard": rows_per_shard,
            "aux_layer_ids": list(aux_layer_ids),
        }
        recorded = self.index.get("layout")
        if recorded is not None and recorded != layout:
            raise DataError(
                f"cache {self.dir} holds other data/settings ({recorded}); wanted {layout}: use another directory"
            )
        if recorded is None:
            self.index["layout"] = layout
            self._save_index()
        n_shards = (len(packed_rows) + rows_per_shard - 1) // rows_per_shard
        it = range(n_shards)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, desc="verifier hidden states", unit="shard")
        for i in it:
            if self.has_shard(i):
                continue
            rows = packed_rows[i * rows_per_shard : (i + 1) * rows_per_shard]
            out = []
            for p in rows:
                aux, last = hidden_states.verifier_hidden_states(verifier, p, aux_layer_ids)
                ex = eagle_shift(p, aux, last)
                out.append(ex.to("cpu", dtype) if dtype is not None else ex.to("cpu"))
            self.write_shard(i, out)
        return n_shards


def _jsonable(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=str))
