"""What keeps two processes and changed inputs from spoiling a run directory: an exclusive lock
on --output for the life of a run, and fingerprints of the data files and verifier weights
that --resume compares with the checkpoint's."""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from .settings import TrainError

LOCK_NAME = ".peagle-train.lock"


class OutputLock:
    """flock on DIR/.peagle-train.lock: a second `peagle train` on the same --output (fresh or
    --resume) fails at once instead of interleaving checkpoints and log lines with the first.
    The kernel drops the lock when the process dies, so a killed run never leaves it stale."""

    def __init__(self, out: Path):
        self.path = out / LOCK_NAME
        self._fd = None

    def acquire(self) -> OutputLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise TrainError(f"--output {self.path.parent}: cannot create {self.path.name}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise TrainError(
                f"--output {self.path.parent} is in use by another peagle train (pid {holder}); "
                "wait for it to finish, or pick another --output"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self):
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (unlinking would race)
            self._fd = None


# files of a verifier directory whose change changes the hidden states or the vocab
_VERIFIER_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json", ".model", ".txt", ".jinja")
_EDGE = 1 << 20  # bytes hashed at each end of a file


def _file_fingerprint(f: Path) -> str:
    """size + sha256 of the first and last MiB: cheap on a 100 GB verifier, and an in-place
    edit, truncation, append or replacement by another file of any size changes it."""
    st = f.stat()
    h = hashlib.sha256(str(st.st_size).encode())
    with open(f, "rb") as fh:
        h.update(fh.read(_EDGE))
        if st.st_size > _EDGE:
            fh.seek(max(_EDGE, st.st_size - _EDGE))
            h.update(fh.read(_EDGE))
    return h.hexdigest()[:32]


def fingerprint_paths(paths: list[Path], suffixes: tuple[str, ...] | None = None) -> dict[str, str]:
    out = {}
    for p in paths:
        if p.is_file():
            out[str(p)] = _file_fingerprint(p)
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and (suffixes is None or f.suffix in suffixes) and ".cache" not in f.parts:
                    out[str(f)] = _file_fingerprint(f)
    return out


def verifier_fingerprints(s) -> dict[str, str] | None:
    """Fingerprints of the verifier's files: a local directory or GGUF file; the bundled
    'smollm2' GGUF; a hub id's snapshot in the local Hugging Face cache (its path names the
    commit, so another revision shows as other files). None for a hub id not in the cache yet:
    the trainer fingerprints it once it has loaded it."""
    from ..data.verifier import _HUB_PATTERNS, hub_cache_dir, looks_like_hub_id, smollm2_gguf_path

    spec = str(s.verifier)
    v = Path(spec).expanduser()
    if v.exists():
        return fingerprint_paths([v], _VERIFIER_SUFFIXES)
    if spec.lower() == "smollm2":
        try:
            return fingerprint_paths([smollm2_gguf_path()])
        except ValueError:  # not installed: the verifier's loader says so
            return {}
    if not looks_like_hub_id(spec):
        return {}
    from huggingface_hub import snapshot_download

    try:
        snap = snapshot_download(
            spec,
            revision=getattr(s, "verifier_revision", None),
            cache_dir=str(hub_cache_dir()),
            allow_patterns=_HUB_PATTERNS,
            local_files_only=True,
        )
    except Exception:  # not (completely) in the cache: fingerprinted after the download
        return None
    return fingerprint_paths([Path(snap)], _VERIFIER_SUFFIXES)


def input_fingerprints(s) -> dict:
    """Fingerprints of the inputs of run settings `s`: local data files (bundled data names are
    the installed package's) and the verifier (verifier_fingerprints)."""
    data = s.data if isinstance(s.data, list) else [s.data]
    local = [Path(d) for d in data if Path(d).exists()]
    return {"data": fingerprint_paths(local), "verifier": verifier_fingerprints(s)}


def check_inputs_unchanged(old: dict | None, new: dict, ck: Path, accept: bool) -> str | None:
    """--resume: refuse when a data file or the verifier changed since checkpoint `ck` was
    written (the resumed run would silently train on other rows or other hidden states), unless
    --accept-changed-inputs: then the line to log, saying what changed."""
    if not isinstance(old, dict):
        return None  # a checkpoint from before fingerprints were recorded: nothing to compare
    changed = []
    for kind in ("data", "verifier"):
        a, b = old.get(kind), new.get(kind)
        # nothing recorded then (a hub verifier before it was fingerprinted) or nothing to
        # read yet (a hub verifier not in the cache now): no comparison
        if not isinstance(a, dict) or not a or not isinstance(b, dict):
            continue
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                state = "missing now" if name not in b else ("new" if name not in a else "changed")
                changed.append(f"{kind} file {name} ({state})")
    if not changed:
        return None
    shown = "; ".join(changed[:5]) + (f"; and {len(changed) - 5} more" if len(changed) > 5 else "")
    if not accept:
        raise TrainError(
            f"--resume: the inputs changed since {ck.name} was written: {shown}. Resuming would train "
            "on other data or hidden states than the checkpoint's; restore them, or pass "
            "--accept-changed-inputs to continue anyway"
        )
    return f"--accept-changed-inputs: continuing although the inputs changed since {ck.name}: {shown}"
