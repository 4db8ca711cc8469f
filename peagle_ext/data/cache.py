"""Offline cache of TrainingExamples: safetensors shards + an index JSON with sha256 per shard.

Layout of a cache directory:
    index.json                    {"version": 1, "meta": {...}, "layout": {...}, "shards": {"<i>":
                                   {"file", "sha256", "bytes", "rows"}}}  (rewritten atomically
                                   after every shard; layout = data fingerprint + shard size)
    shard-000000.safetensors      rows [0, R) stacked: input_ids [R, N] int64, document_ids [R, N]
                                  int32, loss_mask [R, N] bool, hidden [R, N, n_aux*H],
                                  last_hidden [R, N, H]
                                  (fp8 storage: hidden / last_hidden in float8_e4m3fn plus
                                  hidden_scale [R, N] / last_hidden_scale [R, N] float32, one
                                  scale per position, dequantized on read)
Every file is written to a temporary name and renamed into place, so an interrupted run leaves
either a complete shard or none; a shard not (yet) in the index is regenerated. Reads verify the
recorded sha256 and raise DataError on mismatch. Several processes may fill one cache at once
(generate(rank=, world=) gives each its own shards): index updates are serialised by an flock on
index.json.lock and merge what the others wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import tempfile
import time

import torch

from . import hidden_states
from .records import DataError, PackedSequence, TrainingExample, examples_to_host
from .shift import eagle_shift

INDEX = "index.json"
_FIELDS = ("input_ids", "document_ids", "loss_mask", "hidden", "last_hidden")
_QUANTIZED = ("hidden", "last_hidden")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., F] -> (float8_e4m3fn [..., F], float32 scale [...]): one scale per row (position),
    amax / 448, so every row uses the full fp8 range; all-zero rows (padding) get scale 1."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


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


def _index_problem(index: dict) -> str | None:
    """What is wrong with the shape of a parsed index, or None. A shard's file must be exactly the
    name this cache gives shard i: an entry like "../../x" would read files outside the cache."""
    if not isinstance(index.get("meta"), dict):
        return "meta must be an object"
    if "layout" in index and not isinstance(index["layout"], (dict, type(None))):
        return "layout must be an object"
    shards = index.get("shards")
    if not isinstance(shards, dict):
        return "shards must be an object"
    for k, rec in shards.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 9:
            return f"shard key {k[:40]!r} is not a shard number"
        if not isinstance(rec, dict):
            return f"shard {k} must be an object"
        if rec.get("file") != f"shard-{int(k):06d}.safetensors":
            return f"shard {k} names file {str(rec.get('file'))[:80]!r}, expected shard-{int(k):06d}.safetensors"
        sha = rec.get("sha256")
        if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            return f"shard {k} has no sha256"
        for f in ("bytes", "rows"):
            v = rec.get(f)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= (1 if f == "rows" else 0)):
                return f"shard {k}: {f} must be an int, got {v!r}"
    return None


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
        with self._locked():
            index = self._read_index()
            if index is not None:
                self.index = index
                if meta is not None and self.index.get("meta") != _jsonable(meta):
                    raise DataError(
                        f"cache {self.dir} was built with different settings:\n  cached: "
                        f"{self.index.get('meta')}\n  wanted: {_jsonable(meta)}\nuse another directory "
                        "or delete this one"
                    )
            else:
                self.index = {"version": 1, "meta": _jsonable(meta or {}), "shards": {}}
                self._save_index()

    def _read_index(self) -> dict | None:
        index_path = self.dir / INDEX
        if not index_path.is_file():
            return None
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"cache index {index_path} is corrupted: {e}") from None
        except (RecursionError, ValueError) as e:
            raise DataError(f"cache index {index_path} is corrupted: {type(e).__name__}") from None
        if not isinstance(index, dict) or index.get("version") != 1:
            raise DataError(f"cache index {index_path} has an unknown format")
        problem = _index_problem(index)
        if problem:
            raise DataError(f"cache index {index_path} is corrupted: {problem}")
        return index

    @contextlib.contextmanager
    def _locked(self):
        """Exclusive use of the index among the processes filling this cache."""
        with open(self.dir / (INDEX + ".lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def refresh(self) -> None:
        """Re-read the index (the shards other processes have written since)."""
        with self._locked():
            index = self._read_index()
        if index is not None:
            self.index = index

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

    def write_shard(self, i: int, examples: list[TrainingExample], *, fp8: bool = False) -> None:
        """Store examples as shard i; fp8: hidden / last_hidden as float8_e4m3fn with a float32
        scale per position (see quantize_fp8)."""
        from safetensors.torch import save

        if not examples:
            raise ValueError("examples must not be empty")
        try:
            tensors = {f: torch.stack([getattr(e, f).detach().cpu() for e in examples]).contiguous() for f in _FIELDS}
        except RuntimeError as e:
            raise ValueError(f"examples of one shard must have equal shapes: {e}") from None
        if fp8:
            for f in _QUANTIZED:
                tensors[f], tensors[f + "_scale"] = quantize_fp8(tensors[f])
        data = save(tensors, metadata={"rows": str(len(examples))})
        path = self.shard_path(i)
        _atomic_write_bytes(path, data)
        sha = hashlib.sha256(data).hexdigest()
        entry = {"file": path.name, "sha256": sha, "bytes": len(data), "rows": len(examples)}
        with self._locked():  # merge with what other writers recorded meanwhile
            self.index = self._read_index() or self.index
            self.index["shards"][str(i)] = entry
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
        missing = [f for f in _FIELDS if f not in t]
        if missing:
            raise DataError(f"cache shard {path} lacks {', '.join(missing)}")
        for f in _QUANTIZED:
            if f + "_scale" in t:
                t[f] = dequantize_fp8(t[f], t.pop(f + "_scale"))
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
        fp8: bool = False,
        progress: bool = False,
        rank: int = 0,
        world: int = 1,
        after_shard=None,
        batched: bool | None = None,
    ) -> int:
        """Compute (verifier_hidden_states + eagle_shift) for every packed row and store it, shard i
        holding rows [i*R, (i+1)*R). Shards already present are skipped (resume). The data
        fingerprint, aux ids and shard size are recorded in the index and must match on resume.
        dtype: storage dtype of hidden/last_hidden (default: the verifier's); fp8: float8 with a
        scale per position instead. rank / world: this process writes shards i with
        i % world == rank (the others write theirs into the same cache at the same time; see
        wait_complete). after_shard(i): called after each shard this process writes. batched:
        compute several shards' rows in one verifier pass (hidden_states.rows_per_pass of them,
        documents grouped by length into forwards of PASS_TOKENS) and move them to the host in
        one copy per field; None: when the verifier is on a GPU, where row by row costs launches
        and a blocking copy per tensor. Batched states agree with row-by-row ones to float
        rounding; row by row they are the bits that computing a row alone gives. Returns the
        shard count of the whole cache."""

        if isinstance(rows_per_shard, bool) or not isinstance(rows_per_shard, int) or rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be a positive int, got {rows_per_shard!r}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world), got rank {rank}, world {world}")
        if not packed_rows:
            raise DataError("packed_rows is empty: nothing to cache")
        layout = {
            "data_sha256": packed_fingerprint(packed_rows),
            "rows": len(packed_rows),
            "rows_per_shard": rows_per_shard,
            "aux_layer_ids": list(aux_layer_ids),
        }
        with self._locked():
            self.index = self._read_index() or self.index
            recorded = self.index.get("layout")
            if recorded is not None and recorded != layout:
                raise DataError(
                    f"cache {self.dir} holds other data/settings ({recorded}); wanted {layout}: use another directory"
                )
            if recorded is None:
                self.index["layout"] = layout
                self._save_index()
        n_shards = (len(packed_rows) + rows_per_shard - 1) // rows_per_shard
        mine = [i for i in range(rank, n_shards, world) if not self.has_shard(i)]
        if mine:  # one storage format per cache: a resume with other flags must not mix them
            want = "fp8" if fp8 else str(dtype) if dtype is not None else "verifier dtype"
            with self._locked():
                self.index = self._read_index() or self.index
                have = self.index.setdefault("storage", want)
                if have != want:
                    raise DataError(
                        f"cache {self.dir} stores hidden states as {have}; this run would add {want}: "
                        "use the same storage dtype or another directory"
                    )
                self._save_index()
        if mine and verifier is None:
            raise DataError(f"cache {self.dir} lacks shard {mine[0]} and no verifier was loaded to compute it")
        if batched is None:
            batched = bool(mine) and next(verifier.parameters()).device.type == "cuda"
        group = 1
        if batched and mine:
            group = max(1, hidden_states.rows_per_pass(verifier, packed_rows, len(aux_layer_ids)) // rows_per_shard)
        bar = None
        if progress and mine:
            from tqdm import tqdm

            desc = "verifier hidden states" + (f" (rank {rank})" if world > 1 else "")
            bar = tqdm(total=len(mine), desc=desc, unit="shard")
        for g in range(0, len(mine), group):
            shards = mine[g : g + group]
            rows = [p for i in shards for p in packed_rows[i * rows_per_shard : (i + 1) * rows_per_shard]]
            if batched:
                states = hidden_states.verifier_hidden_states_many(
                    verifier, rows, aux_layer_ids, token_budget=hidden_states.PASS_TOKENS
                )
                shifted = [eagle_shift(p, aux, last) for p, (aux, last) in zip(rows, states)]
                del states
                out = examples_to_host(shifted, dtype)
            else:
                out = []
                for p in rows:
                    aux, last = hidden_states.verifier_hidden_states(verifier, p, aux_layer_ids)
                    ex = eagle_shift(p, aux, last)
                    out.append(ex.to("cpu", dtype) if dtype is not None else ex.to("cpu"))
            k = 0
            for i in shards:
                n = len(packed_rows[i * rows_per_shard : (i + 1) * rows_per_shard])
                self.write_shard(i, out[k : k + n], fp8=fp8)
                k += n
                if after_shard is not None:
                    after_shard(i)
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return n_shards

    def missing_shards(self, n_shards: int) -> list[int]:
        return [i for i in range(n_shards) if not self.has_shard(i)]

    def wait_complete(self, n_shards: int, *, timeout_s: float = 600.0, poll_s: float = 1.0, world: int = 1) -> None:
        """Until every one of n_shards is in the index (written by any process). Gives up with a
        DataError naming the missing shards (and, with `world`, the ranks that own them) when no
        new shard has appeared for timeout_s seconds: a rank that died or hangs never leaves the
        others waiting forever. Rerunning resumes from the shards that exist."""
        last_count, last_change = -1, time.monotonic()
        while True:
            self.refresh()
            missing = self.missing_shards(n_shards)
            if not missing:
                return
            if len(missing) != last_count:
                last_count, last_change = len(missing), time.monotonic()
            elif time.monotonic() - last_change > timeout_s:
                owners = sorted({i % world for i in missing})
                raise DataError(
                    f"cache {self.dir}: {len(missing)} of {n_shards} shards (e.g. {missing[:5]}) did not appear "
                    f"within {timeout_s:.0f} s"
                    + (f"; they belong to rank(s) {owners}, which died or stalled" if world > 1 else "")
                    + ". Run again to resume: the shards written so far are kept"
                )
            time.sleep(poll_s)


def _jsonable(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=str))
