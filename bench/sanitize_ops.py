"""Runs every op's compute-sanitizer driver (bench/sanitize_<op>.py) in one process, so
`compute-sanitizer --tool T python3 bench/sanitize_ops.py` covers all CUDA ops per tool.
Each driver exposes main() or run(); small sizes, results checked against the CPU ops."""
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(names=None):
    drivers = sorted(p.stem for p in HERE.glob("sanitize_*.py") if p.stem != "sanitize_ops")
    if names:
        drivers = [d for d in drivers if d.removeprefix("sanitize_") in names]
    for name in drivers:
        mod = importlib.import_module(name)
        fn = getattr(mod, "main", None) or getattr(mod, "run")
        print(f"-- {name}", flush=True)
        fn()
    print("sanitize_ops: all drivers ran:", ", ".join(drivers))


if __name__ == "__main__":
    main(sys.argv[1:])
