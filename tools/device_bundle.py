"""The inputs of the SmolLM2 GPU study (scripts/smollm2_gpu.sh) for a machine with no network and
a limit on the files each run may carry: written here, joined there.

    python tools/device_bundle.py pack BUNDLE [--max-tokens 2048] [--part-mib MIB]
        BUNDLE/sharegpt.jsonl.xz      every usable ShareGPT conversation, {"messages": [...]} a
                                      line, each cut after the message that crosses --max-tokens
                                      tokens of SmolLM2's chat template (plus a margin), which is
                                      all a run at that seq-len reads of it
        BUNDLE/mtbench.jsonl          the 80 MT-Bench first turns and the 164 HumanEval problems,
        BUNDLE/humaneval.jsonl        as the prompts `peagle eval --bench mtbench|humaneval` uses
        BUNDLE/verifier/              SmolLM2's config, tokenizer and chat template files
        BUNDLE/gguf.part00, ...       the SmolLM2 GGUF cut in parts of at most --part-mib MiB (by
                                      default as large as each run leaves beside the repository:
                                      `part_sizes`)
        BUNDLE/gguf/                  the pure-Python `gguf` package transformers reads GGUF with,
        BUNDLE/gguf-*.dist-info/      and its metadata (transformers checks its version)
        BUNDLE/MANIFEST.json          sizes and sha256 of everything, and which files a run carries
    python tools/device_bundle.py check BUNDLE
        whether each run in BUNDLE/MANIFEST.json, with the files its entries hold now, still fits the
        64 MiB beside the repository as it is now (exit 1 naming the runs that do not: pack again with
        --keep-data, which cuts the GGUF anew and keeps the data; or naming the largest file of a run
        that grew since pack, such as a verifier converted here, or an entry gone); run it before the
        first device call of a session
    python tools/device_bundle.py join BUNDLE [--if-complete]
        joins the parts into BUNDLE/verifier.gguf (checking the sha256) and converts it into the
        transformers directory BUNDLE/verifier/ (peagle_ext.data.convert_gguf_to_hf)

    python tools/device_bundle.py save-regen DATA OUT --turns T --loops M --max-new-tokens N --max-length L
        the study's regenerated data (DATA/regen.jsonl, DATA/heldout_regen.jsonl) as one xz tar cut in
        parts of at most --part-mib MiB (OUT/regen.tar.xz.part00, ...) and OUT/regen.json (their
        sha256, the sha256 of the DATA/train.jsonl and heldout.jsonl it answers, the datagen settings)
    python tools/device_bundle.py seed-regen BUNDLE DATA --turns T --loops M --max-new-tokens N --max-length L
        with those files carried into BUNDLE: puts them back into DATA when they answer the same
        train.jsonl with the same settings and hold more conversations than DATA has, so `peagle
        datagen` continues a later session where an earlier one stopped (exit 0 either way; it says
        which)

The parts exist because one run carries at most 64 MiB: the runs that carry the parts must follow
each other on one machine (files written there outside $OUT survive between runs only while the
machine is held); the manifest's "runs" says which files go with which run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMALL_VERIFIER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def truncate_conversation(tokenizer, messages: list[dict], max_tokens: int, margin: int = 64) -> list[dict]:
    """What a run at seq-len max_tokens reads of a conversation: the messages up to character
    `cut`, where token max_tokens + margin of the rendered conversation starts, the one crossing
    it cut there. BPE merges are local, so the first max_tokens tokens and their loss mask are
    the untruncated conversation's. When that leaves a user turn last, the next answer follows it
    cut to a few characters (all beyond the cut): loaders drop a conversation's trailing user
    turns, and this one counts. Unchanged when the contents are not verbatim in the rendering."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    offs = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offs) <= max_tokens + margin:
        return messages
    cut = offs[max_tokens + margin][0]
    out, pos = [], 0
    for m in messages:
        start = text.find(m["content"], pos)
        if start < 0:
            return messages
        if start >= cut:
            break
        end = start + len(m["content"])
        out.append(m if end <= cut else {"role": m["role"], "content": m["content"][: cut - start]})
        pos = end
        if end > cut:
            break
    if out and out[-1]["role"] != "assistant":
        nxt = next((m for m in messages[len(out) :] if m["role"] == "assistant"), None)
        if nxt is None:
            return messages
        out.append({"role": "assistant", "content": nxt["content"][:16]})
    return out


CARRY_LIMIT = 64 * 2**20  # bytes a device call carries, the repository's files included
GROWTH_HEADROOM = 12 * 2**20  # what the repository may grow by between the pack and the runs (a study
# session's results add a few MiB; `check` says when a pack no longer fits)


def repository_bytes(root: Path) -> int:
    """The bytes of the files a device call carries from the repository at `root`: tracked files
    and untracked ones git does not ignore."""
    import subprocess

    r = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    )
    files = (root / f for f in r.stdout.decode().split("\0") if f)
    return sum(f.stat().st_size for f in files if f.is_file())


def part_sizes(gguf_bytes: int, repo_bytes: int, setup_bytes: int) -> tuple[int, int]:
    """(the first part's bytes, every later part's): the first goes with setup's files, each later
    one alone, each run beside the repository and GROWTH_HEADROOM inside CARRY_LIMIT."""
    first = CARRY_LIMIT - repo_bytes - GROWTH_HEADROOM - setup_bytes
    later = CARRY_LIMIT - repo_bytes - GROWTH_HEADROOM
    if first < 2**20:
        raise SystemExit(
            f"device_bundle: the repository ({repo_bytes / 2**20:.1f} MiB) and setup's files "
            f"({setup_bytes / 2**20:.1f} MiB) leave no room for a GGUF part in a {CARRY_LIMIT >> 20} MiB run"
        )
    return min(first, gguf_bytes), later


def pack(bundle: Path, max_tokens: int, part_mib: float | None, limit: int | None, keep_data: bool = False):
    import importlib.util

    from peagle_ext.data import load_conversations, load_eval_prompts, resolve_verifier_path, smollm2_gguf_path

    bundle.mkdir(parents=True, exist_ok=True)
    vdir = resolve_verifier_path("smollm2")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vdir, local_files_only=True)
    (bundle / "verifier").mkdir(exist_ok=True)
    for name in SMALL_VERIFIER_FILES:
        shutil.copy2(vdir / name, bundle / "verifier" / name)
    if (vdir / "chat_template.jinja").is_file():
        shutil.copy2(vdir / "chat_template.jinja", bundle / "verifier" / "chat_template.jinja")

    convs = load_conversations("sharegpt", limit=limit)
    raw_chars = sum(len(m["content"]) for c in convs for m in c)
    kept_chars = 0
    data = bundle / "sharegpt.jsonl.xz"
    old = bundle / "MANIFEST.json"
    old = json.loads(old.read_text()) if old.is_file() else {}
    if keep_data and data.is_file() and old.get("max_tokens") == max_tokens and old.get("conversations") == len(convs):
        kept_chars = old["content_chars"]["kept"]  # the data of an earlier pack with these settings
    else:
        with lzma.open(data, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
            for c in convs:
                t = truncate_conversation(tok, c, max_tokens)
                kept_chars += sum(len(m["content"]) for m in t)
                f.write(json.dumps({"messages": t}, ensure_ascii=False) + "\n")
    for bench in ("mtbench", "humaneval"):
        with open(bundle / f"{bench}.jsonl", "w", encoding="utf-8") as f:
            for msgs in load_eval_prompts(bench):
                f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")

    spec = importlib.util.find_spec("gguf")
    pkg = Path(list(spec.submodule_search_locations)[0])
    shutil.rmtree(bundle / "gguf", ignore_errors=True)
    shutil.copytree(pkg, bundle / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    # transformers reads the package's version from its metadata: the dist-info travels beside it
    import importlib.metadata

    dist = importlib.metadata.distribution("gguf")
    for old_info in bundle.glob("gguf-*.dist-info"):
        shutil.rmtree(old_info)
    info = bundle / f"gguf-{dist.version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        dist.read_text("METADATA") or f"Metadata-Version: 2.1\nName: gguf\nVersion: {dist.version}\n"
    )

    gguf = smollm2_gguf_path()
    for old_part in bundle.glob("gguf.part*"):
        old_part.unlink()
    repo = repository_bytes(Path(__file__).resolve().parents[1])
    if part_mib is None:
        setup = [f for f in bundle.rglob("*") if f.is_file() and _carried_by_setup(f.relative_to(bundle).parts[0])]
        setup_bytes = sum(f.stat().st_size for f in setup) + 2**20  # + the manifest, written last
        first, later = part_sizes(gguf.stat().st_size, repo, setup_bytes)
    else:
        first = later = int(part_mib * 2**20)
    parts = []
    with open(gguf, "rb") as src:
        while True:
            chunk = src.read(first if not parts else later)
            if not chunk:
                break
            p = bundle / f"gguf.part{len(parts):02d}"
            p.write_bytes(chunk)
            parts.append(p.name)
    files = sorted(p for p in bundle.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    sizes = {str(p.relative_to(bundle)): p.stat().st_size for p in files}
    mib = 2**20
    manifest = {
        "max_tokens": max_tokens,
        "conversations": len(convs),
        "content_chars": {"original": raw_chars, "kept": kept_chars},
        "gguf": {"name": gguf.name, "size": gguf.stat().st_size, "sha256": _sha256(gguf), "parts": parts},
        "files": {k: {"bytes": v, "sha256": _sha256(bundle / k)} for k, v in sizes.items()},
        # what each run carries (besides the repository): the parts go with runs on one machine
        "runs": plan_runs(sizes, parts),
    }
    (bundle / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for k, v in sizes.items():
        print(f"{v / mib:8.2f} MiB  {k}")
    print(
        f"{len(convs)} conversations, content {raw_chars / 1e6:.1f}M -> {kept_chars / 1e6:.1f}M characters "
        f"(cut after {max_tokens} tokens + margin); runs: "
        + ", ".join(f"{r['mib']:.1f} MiB" for r in manifest["runs"])
        + f", each with the repository's {repo / mib:.1f} MiB"
    )
    over = [i + 1 for i, r in enumerate(manifest["runs"]) if r["mib"] * mib + repo > CARRY_LIMIT]
    if over:
        print(
            f"device_bundle: run(s) {over} carry more than {CARRY_LIMIT >> 20} MiB with the repository: "
            "pack again with a smaller --part-mib",
            file=sys.stderr,
        )


def _entry_files(bundle: Path, name: str) -> list[Path]:
    """The files a carried entry of the bundle (a file or a directory) sends."""
    p = bundle / name
    if p.is_dir():
        return [f for f in p.rglob("*") if f.is_file()]
    return [p] if p.is_file() else []


def check(bundle: Path, repo_bytes: int | None = None) -> int:
    """0 when every run of the bundle's manifest fits CARRY_LIMIT beside the repository (its size
    now, or repo_bytes), else 1; one line per run either way. A run counts the files its entries
    hold now, not what pack wrote: a local `join` or `data` phase leaves the converted verifier
    (~260 MiB) in verifier/, which setup's run would carry, and an entry gone from the bundle
    cannot be carried at all."""
    man_path = bundle / "MANIFEST.json"
    try:
        runs = json.loads(man_path.read_text())["runs"]
    except (OSError, ValueError, KeyError) as e:
        print(f"device_bundle check: {man_path} is not a bundle manifest ({e}); pack the bundle first", file=sys.stderr)
        raise SystemExit(2) from None
    repo = repository_bytes(Path(__file__).resolve().parents[1]) if repo_bytes is None else repo_bytes
    over, missing, grown, notes = [], [], [], []
    for i, r in enumerate(runs, 1):
        gone = [n for n in r["carry"] if not (bundle / n).exists()]
        files = [f for n in r["carry"] for f in _entry_files(bundle, n)]
        now = sum(f.stat().st_size for f in files)
        total = now + repo
        print(f"run {i}: {total / 2**20:5.1f} MiB with the repository's {repo / 2**20:.1f} ({' '.join(r['carry'])})")
        if gone:
            missing.append(f"run {i}: {', '.join(gone)}")
        if now > r["mib"] * 2**20 + 2**20:
            big = max(files, key=lambda f: f.stat().st_size)
            grown.append(i)
            notes.append(
                f"run {i} holds {now / 2**20:.1f} MiB, packed as {r['mib']:.1f}; its largest file is "
                f"{big.relative_to(bundle)} ({big.stat().st_size / 2**20:.1f} MiB): remove what was added"
            )
        if total > CARRY_LIMIT:
            over.append(i)
    for line in notes:
        print(f"device_bundle check: {line}", file=sys.stderr)
    if missing:
        print(f"device_bundle check: not in {bundle}: {'; '.join(missing)} (pack the bundle again)", file=sys.stderr)
    repack = [i for i in over if i not in grown]  # a grown run needs the added files gone, not a re-pack
    if repack:
        print(
            f"device_bundle check: run(s) {repack} carry more than {CARRY_LIMIT >> 20} MiB: "
            f"python tools/device_bundle.py pack {bundle} --keep-data",
            file=sys.stderr,
        )
    return 1 if over or missing else 0


def _carried_by_setup(top: str) -> bool:
    """Whether a top-level entry of the bundle goes with the first run (what setup reads)."""
    return top in ("gguf", "verifier", "MANIFEST.json") or top.endswith(".dist-info")


def plan_runs(sizes: dict[str, int], parts: list[str]) -> list[dict]:
    """What each run carries, by top-level entry of the bundle (sizes: path -> bytes; parts: the
    GGUF's parts in order). A device call takes at most 8 carried paths and 64 MiB with the
    repository, which needs ~10 of them: the first part goes with what setup reads (the package,
    its metadata, the verifier's config), each other part alone, then the data and the prompts
    (the regenerated data a `keep` brings back is carried beside them later)."""
    tops = {k.split("/")[0] for k in sizes}
    setup = sorted(t for t in tops if _carried_by_setup(t)) + ["MANIFEST.json"]
    data = [t for t in ("sharegpt.jsonl.xz", "mtbench.jsonl", "humaneval.jsonl") if t in tops]

    def run(carry):
        return {"carry": carry, "mib": sum(v for k, v in sizes.items() if k.split("/")[0] in carry) / 2**20}

    return [run([*setup, parts[0]]), *[run([p]) for p in parts[1:]], run(data)]


def join(bundle: Path, if_complete: bool = False):
    if (bundle / "verifier" / "model.safetensors").is_file():
        print(f"verifier: {bundle / 'verifier'} (joined before)")
        return
    man = json.loads((bundle / "MANIFEST.json").read_text())
    g = man["gguf"]
    out = bundle / "verifier.gguf"
    if not (out.is_file() and out.stat().st_size == g["size"] and _sha256(out) == g["sha256"]):
        missing = [p for p in g["parts"] if not (bundle / p).is_file()]
        if missing and if_complete:
            print(f"device_bundle join: {', '.join(missing)} not here yet; nothing joined")
            return
        if missing:
            raise SystemExit(f"device_bundle join: missing {', '.join(missing)} in {bundle} (carry every part first)")
        tmp = out.with_suffix(".tmp")
        with open(tmp, "wb") as dst:
            for p in g["parts"]:
                with open(bundle / p, "rb") as src:
                    shutil.copyfileobj(src, dst)
        if _sha256(tmp) != g["sha256"]:
            tmp.unlink()
            raise SystemExit("device_bundle join: the joined GGUF does not match the manifest's sha256")
        tmp.replace(out)
    if not (bundle / "verifier" / "model.safetensors").is_file():
        sys.path.insert(0, str(bundle))  # the bundled gguf package
        from peagle_ext.data import convert_gguf_to_hf

        small = {n: (bundle / "verifier" / n).read_bytes() for n in SMALL_VERIFIER_FILES}
        convert_gguf_to_hf(out, bundle / "verifier")
        for n, b in small.items():  # the tokenizer and config as converted where the bundle was made
            (bundle / "verifier" / n).write_bytes(b)
    print(f"verifier: {bundle / 'verifier'}")


REGEN_FILES = ("regen.jsonl", "heldout_regen.jsonl")
REGEN_ANSWERS = ("train.jsonl", "heldout.jsonl")


def _lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def save_regen(data: Path, out: Path, settings: dict, part_mib: float = 15.0) -> dict:
    """DATA's regenerated files as OUT/regen.tar.xz.partNN + OUT/regen.json (module docstring)."""
    import io
    import tarfile

    missing = [n for n in REGEN_FILES[:1] + REGEN_ANSWERS if not (data / n).is_file()]
    if missing:
        raise SystemExit(f"device_bundle save-regen: {data} has no {', '.join(missing)}")
    buf = io.BytesIO()
    with lzma.open(buf, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for n in REGEN_FILES:
            if (data / n).is_file():
                tar.add(data / n, arcname=n)
    blob, step = buf.getvalue(), int(part_mib * 2**20)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("regen.tar.xz.part*"):  # an earlier, larger save's parts would travel too
        old.unlink()
    parts = []
    for i in range(0, len(blob), step):
        name = f"regen.tar.xz.part{len(parts):02d}"
        (out / name).write_bytes(blob[i : i + step])
        parts.append({"name": name, "sha256": hashlib.sha256(blob[i : i + step]).hexdigest()})
    meta = {
        "parts": parts,
        "answers": {n: _sha256(data / n) for n in REGEN_ANSWERS},
        "settings": settings,
        "conversations": _lines(data / "regen.jsonl"),
    }
    (out / "regen.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(
        f"save-regen: {meta['conversations']} regenerated conversations in {len(parts)} part(s), "
        f"{len(blob) / 2**20:.1f} MiB, in {out}"
    )
    return meta


def seed_regen(bundle: Path, data: Path, settings: dict) -> bool:
    """Put a carried save-regen back into DATA (module docstring). True when it did."""
    import io
    import tarfile

    mf = bundle / "regen.json"
    if not mf.is_file():
        print(f"seed-regen: no {mf}; datagen starts from nothing")
        return False
    meta = json.loads(mf.read_text())
    why = None
    missing = [p["name"] for p in meta["parts"] if not (bundle / p["name"]).is_file()]
    if missing:
        why = f"{', '.join(missing)} not carried"
    elif meta["settings"] != settings:
        why = f"it was generated with {meta['settings']}, this run asks for {settings}"
    else:
        for n, h in meta["answers"].items():
            if not (data / n).is_file() or _sha256(data / n) != h:
                why = f"it answers another {n} than {data / n}"
                break
    have = _lines(data / "regen.jsonl") if (data / "regen.jsonl").is_file() else 0
    if why is None and have >= meta["conversations"]:
        why = f"{data / 'regen.jsonl'} already holds {have} conversations"
    if why is None:
        blob = b""
        for p in meta["parts"]:
            b = (bundle / p["name"]).read_bytes()
            if hashlib.sha256(b).hexdigest() != p["sha256"]:
                why = f"{p['name']} does not match its sha256"
                break
            blob += b
    if why is not None:
        print(f"seed-regen: not used ({why})")
        return False
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(blob)), mode="r") as tar:
        for m in tar.getmembers():
            if m.name not in REGEN_FILES or not m.isfile():
                raise SystemExit(f"seed-regen: unexpected member {m.name!r} in the carried tar")
            tmp = data / (m.name + ".seed.tmp")
            tmp.write_bytes(tar.extractfile(m).read())
            tmp.replace(data / m.name)
    print(f"seed-regen: {meta['conversations']} regenerated conversations put back into {data}")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("bundle")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument(
        "--part-mib",
        type=float,
        default=None,
        help="GGUF part size (default: as large as each run leaves beside the repository and setup's files)",
    )
    p.add_argument("--limit", type=int, default=None, help="first N conversations only (a quick check)")
    p.add_argument("--keep-data", action="store_true", help="keep BUNDLE/sharegpt.jsonl.xz of an earlier pack")
    c = sub.add_parser("check")
    c.add_argument("bundle")
    j = sub.add_parser("join")
    j.add_argument("bundle")
    j.add_argument("--if-complete", action="store_true", help="exit 0 without joining while parts are missing")
    sv = sub.add_parser("save-regen")
    sv.add_argument("data")
    sv.add_argument("out")
    sv.add_argument("--part-mib", type=float, default=15.0)
    sd = sub.add_parser("seed-regen")
    sd.add_argument("bundle")
    sd.add_argument("data")
    for q in (sv, sd):  # what makes regenerated answers the same: datagen's settings
        q.add_argument("--turns", required=True, choices=["first", "all"])
        q.add_argument("--loops", required=True, choices=["keep", "cut"])
        q.add_argument("--max-new-tokens", type=int, required=True)
        q.add_argument("--max-length", type=int, required=True)
    a = ap.parse_args(argv)
    if a.cmd in ("save-regen", "seed-regen"):
        if a.max_new_tokens < 1 or a.max_length < 2:
            ap.error("--max-new-tokens must be >= 1 and --max-length >= 2")
        st = {"turns": a.turns, "loops": a.loops, "max_new_tokens": a.max_new_tokens, "max_length": a.max_length}
    if a.cmd == "pack":
        if a.part_mib is not None and not a.part_mib > 0:
            ap.error(f"--part-mib must be > 0, got {a.part_mib}")
        pack(Path(a.bundle), a.max_tokens, a.part_mib, a.limit, a.keep_data)
    elif a.cmd == "check":
        return check(Path(a.bundle))
    elif a.cmd == "join":
        join(Path(a.bundle), a.if_complete)
    elif a.cmd == "save-regen":
        if not 0 < a.part_mib <= 16:
            ap.error(f"--part-mib must be in (0, 16] (a device run returns files of at most 16 MiB), got {a.part_mib}")
        save_regen(Path(a.data), Path(a.out), st, a.part_mib)
    else:
        seed_regen(Path(a.bundle), Path(a.data), st)
    return 0


if __name__ == "__main__":
    sys.exit(main())
