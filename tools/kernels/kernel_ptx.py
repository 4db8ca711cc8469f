"""Per-kernel PTX of the CUDA sources, to show that a source change leaves kernels' code alone.

    python tools/kernels/kernel_ptx.py dump ROOT OUT.json            # every csrc/*/cuda/*.cu of ROOT
    python tools/kernels/kernel_ptx.py compare OLD.json NEW.json [--rename 'REGEX=>REPL' ...]

`dump` compiles each kernel file with `nvcc -O3 -ptx` (the build's flags, PEAGLE_ATTN_WGMMA on)
for compute_90 and compute_90a, cuts the PTX into its `.entry` functions and normalises each one:
comment and `.file` / `.loc` lines dropped, the anonymous-namespace hashes (`_GLOBAL__N__<hex>_`,
`_INTERNAL_<hex>_`, the file hash in `_ANON_..._cu_<hex>`) replaced by a constant, basic-block labels stripped of the function's index in its file
(`$L__BB<i>_<n>`), and the kernel's own mangled name (which its parameter
names repeat) replaced by `KERNEL`, so a kernel that only lost a template parameter compares
equal. It writes {arch: {demangled name: normalised body}}.

`compare` maps every OLD name through the --rename substitutions (Python regexes, applied in
order to the demangled name; e.g. drop a template argument) and reports, per arch, the kernels
whose bodies are identical, those that differ, those only in OLD (deleted) and only in NEW. Exit
code 1 if any kept kernel differs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ARCHS = ("compute_90", "compute_90a")
_HASHES = (re.compile(r"_GLOBAL__N__[0-9a-fA-F]+_"), re.compile(r"_INTERNAL_[0-9a-fA-F]+_"))
_LABEL = re.compile(r"\$L__BB\d+_")  # block labels carry the function's index in its file
_FILE_HASH = re.compile(r"(_cu_)[0-9a-f]{8}")  # anonymous-namespace names carry a hash of their file
_ENTRY = re.compile(r"^(?:\.visible |\.weak )?\.entry (\S+?)\(", re.M)


def nvcc() -> str:
    found = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(found):
        raise SystemExit("nvcc not found")
    return found


def entries(ptx: str) -> dict[str, str]:
    """Mangled name -> normalised body of every kernel in one PTX file."""
    lines = [
        ln
        for ln in ptx.splitlines()
        if not ln.lstrip().startswith("//") and not ln.lstrip().startswith((".file", ".loc"))
    ]
    text = "\n".join(lines)
    for h in _HASHES:
        text = h.sub("_ANON_", text)
    out = {}
    for m in _ENTRY.finditer(text):
        name = m.group(1)
        end = text.find("\n}\n", m.start())
        body = text[m.start() : end + 2 if end >= 0 else len(text)]
        out[name] = _LABEL.sub("$L__BB_", body.replace(name, "KERNEL"))
    return out


def demangle(names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return dict(zip(names, r.stdout.splitlines()))


def compile_ptx(root: Path, src: Path, arch: str, tmp: Path) -> tuple[str, str, dict[str, str]]:
    out = tmp / f"{src.parent.parent.name}_{src.stem}_{arch}.ptx"
    cmd = [nvcc(), "-std=c++17", "-O3", "--expt-relaxed-constexpr", f"-arch={arch}", "-DPEAGLE_ATTN_WGMMA=1"]
    cmd += ["-I", str(root / "csrc"), "-ptx", str(src), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{src} ({arch}) failed:\n{r.stderr[-3000:]}")
    return str(src.relative_to(root)), arch, entries(out.read_text())


def dump(root: Path, dest: Path, jobs: int) -> None:
    sources = sorted((root / "csrc").glob("*/cuda/*.cu"))
    result: dict[str, dict[str, str]] = {a: {} for a in ARCHS}
    with tempfile.TemporaryDirectory() as tmp, cf.ThreadPoolExecutor(max_workers=jobs) as ex:
        futures = [ex.submit(compile_ptx, root, s, a, Path(tmp)) for s in sources for a in ARCHS]
        for fut in futures:
            src, arch, ents = fut.result()
            names = demangle(list(ents))
            for mangled, body in ents.items():
                result[arch][_FILE_HASH.sub(r"\1H", names[mangled])] = _FILE_HASH.sub(r"\1H", body)
            print(f"{src} {arch}: {len(ents)} kernels", flush=True)
    dest.write_text(json.dumps(result, indent=0, sort_keys=True))


def compare(old_path: Path, new_path: Path, renames: list[str]) -> int:
    old, new = json.loads(old_path.read_text()), json.loads(new_path.read_text())
    subs = []
    for rule in renames:
        pat, _, repl = rule.partition("=>")
        subs.append((re.compile(pat), repl))
    status = 0
    for arch in sorted(set(old) | set(new)):
        mapped = {}
        for name, body in old.get(arch, {}).items():
            for pat, repl in subs:
                name = pat.sub(repl, name)
            mapped[name] = body
        cur = new.get(arch, {})
        same = sorted(n for n in mapped if n in cur and cur[n] == mapped[n])
        differ = sorted(n for n in mapped if n in cur and cur[n] != mapped[n])
        gone = sorted(n for n in mapped if n not in cur)
        added = sorted(n for n in cur if n not in mapped)
        print(f"== {arch}: {len(same)} identical, {len(differ)} differ, {len(gone)} deleted, {len(added)} new")
        for label, names in (("identical", same), ("DIFFER", differ), ("deleted", gone), ("new", added)):
            for n in names:
                print(f"  {label}: {n}")
        status |= 1 if differ else 0
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("root", type=Path)
    d.add_argument("out", type=Path)
    d.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    c.add_argument("--rename", action="append", default=[], help="REGEX=>REPLACEMENT on OLD's demangled names")
    a = ap.parse_args(argv)
    if a.cmd == "dump":
        dump(a.root.resolve(), a.out, a.jobs)
        return 0
    return compare(a.old, a.new, a.rename)


if __name__ == "__main__":
    sys.exit(main())
