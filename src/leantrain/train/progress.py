"""What a run shows while it trains: a tqdm bar on a terminal, otherwise one line every
``train.log_every`` steps (step, loss, lr, tokens/s, memory, time left); and the loss plot."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"


def fmt_seconds(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """``update(row, memory)`` after each step's row is written (``memory()``: the peak bytes, asked
    for only when shown); ``close()`` at the end. On a terminal (stderr a TTY) a tqdm bar; otherwise
    (a file, CI, nohup) a plain line every ``every`` steps and at the last step, flushed at once."""

    def __init__(self, total: int, initial: int, every: int, enabled: bool):
        self.total, self.start, self.every = total, initial, max(every, 1)
        self.t0 = time.perf_counter()
        self.bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, row: dict, memory: Callable[[], int]) -> None:
        if not self.enabled:
            return
        step = row["step"]
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_second']:.0f}",
                                 mem=fmt_bytes(memory()))
            return
        if step % self.every and step != self.total:
            return
        done = step - self.start
        eta = (time.perf_counter() - self.t0) / done * (self.total - step) if done > 0 else 0.0
        print(f"step {step}/{self.total} loss {row['loss']:.4f} lr {row['lr']:.3g} "
              f"tok/s {row['tokens_per_second']:.0f} mem {fmt_bytes(memory())} eta {fmt_seconds(eta)}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_SAID: set[str] = set()


def plot_losses(curves: dict[str, Path], path: Path, title: str = "training loss") -> bool:
    """Loss (and validation loss) against step for each run; False (and one line saying why, once
    per process) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if "plot" not in _SAID:
            _SAID.add("plot")
            print("no loss plot: matplotlib is not installed (pip install 'leantrain[plot]')", flush=True)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, mpath in curves.items():
        rows = [json.loads(line) for line in Path(mpath).read_text().splitlines() if line.strip()]
        if not rows:
            continue
        line, = ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, alpha=0.8, label=f"{name} train")
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if val:
            ax.plot(*zip(*val, strict=True), "o--", color=line.get_color(), ms=3, label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
