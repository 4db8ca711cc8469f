"""loss.png and accuracy.png of a run, from its log.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path


def make_plots(log_path: Path, out: Path, k: int) -> list[Path]:
    """loss.png and accuracy.png (per-depth accuracy) from log.jsonl, train and validation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr, va = [], []
    for line in log_path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("split") == "train" and not r.get("skipped") and math.isfinite(r.get("loss", float("nan"))):
            tr.append(r)
        elif r.get("split") == "val":
            va.append(r)
    paths = []

    def smooth(y, w):
        if len(y) < 3 or w <= 1:
            return y
        out_, acc = [], 0.0
        q = []
        for v in y:
            q.append(v)
            acc += v
            if len(q) > w:
                acc -= q.pop(0)
            out_.append(acc / len(q))
        return out_

    w = max(1, len(tr) // 50)
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        ax.plot([r["step"] for r in tr], smooth([r["loss"] for r in tr], w), label="train")
    if va:
        ax.plot([r["step"] for r in va], [r["loss"] for r in va], "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("KL loss")
    ax.set_title("P-EAGLE drafter loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p = out / "loss.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4))
    cmap = plt.get_cmap("viridis")
    for d in range(k):
        c = cmap(d / max(1, k - 1))
        if tr:
            ax.plot(
                [r["step"] for r in tr], smooth([r["acc"][d] for r in tr], w), color=c, alpha=0.8, label=f"d{d} train"
            )
        if va:
            ax.plot([r["step"] for r in va], [r["acc"][d] for r in va], "o--", color=c, label=f"d{d} val")
    ax.set_xlabel("step")
    ax.set_ylabel("argmax agreement with the verifier")
    ax.set_ylim(0, 1)
    ax.set_title("per-depth accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    p = out / "accuracy.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
