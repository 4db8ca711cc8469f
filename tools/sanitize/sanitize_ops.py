"""Runs every op's compute-sanitizer driver (tools/sanitize/sanitize_<op>.py) in one process, so
`compute-sanitizer --tool T python3 tools/sanitize/sanitize_ops.py [op ...]` covers all CUDA ops per tool
(tools/sanitize/sanitize_all.sh runs it under every tool and records the results).
Each driver exposes main() or run(); small sizes, results checked against the CPU ops. A driver
that fails (assertion, CUDA error) is reported and the others still run; the exit code is 1 if
any failed."""

import importlib
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(names=None) -> int:
    drivers = sorted(p.stem for p in HERE.glob("sanitize_*.py") if p.stem != "sanitize_ops")
    if names:
        unknown = set(names) - {d.removeprefix("sanitize_") for d in drivers}
        if unknown:
            print(f"sanitize_ops: no driver for {sorted(unknown)} (have {drivers})")
            return 2
        drivers = [d for d in drivers if d.removeprefix("sanitize_") in names]
    failed = []
    for name in drivers:
        print(f"-- {name}", flush=True)
        try:
            mod = importlib.import_module(name)
            fn = getattr(mod, "main", None) or mod.run
            fn()
        except Exception:  # noqa: BLE001  (report, run the other drivers, fail at the end)
            traceback.print_exc()
            print(f"-- {name}: FAILED", flush=True)
            failed.append(name)
    ok = [d for d in drivers if d not in failed]
    print("sanitize_ops: drivers ran:", ", ".join(ok) or "none", "| FAILED:", ", ".join(failed) or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
