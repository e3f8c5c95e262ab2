"""``report.md`` of ``leantrain compare``: every recipe as a ratio to the baseline."""

from __future__ import annotations

import json
from pathlib import Path

from leantrain.train.progress import plot_losses


def _ratio(x, base) -> str:
    if x is None or base in (None, 0):
        return "n/a"
    return f"{x / base:.2f}×"


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def write_report(out: Path, results: dict[str, dict]) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = results.get("baseline", {})
    bmem = base.get("memory", {})
    lines = [
        "# leantrain compare",
        "",
        f"Preset and data identical for every run; {base.get('steps', '?')} steps; device {base.get('device', '?')}.",
        "Memory is counted from live tensors at the optimizer step (saved activations measured with saved-tensor hooks "
        "during the forward of the first step); ratios are to the baseline (plain `torch.optim.AdamW`).",
        "",
        "| recipe | final loss | val loss | val vs base | tokens/s | × base | peak MiB | × base | weights MiB | grads MiB | "
        "opt. state MiB | activations MiB | × base | comm B/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results.items():
        m = s.get("memory", {})
        val = s.get("val_loss")
        bval = base.get("val_loss")
        dv = "n/a" if val is None or not bval else f"{100 * (val - bval) / bval:+.2f}%"
        lines.append(
            f"| {name} | {s['final_loss']:.4f} | {val if val is None else f'{val:.4f}'} | {dv} | "
            f"{s['tokens_per_second']:.0f} | {_ratio(s['tokens_per_second'], base.get('tokens_per_second'))} | "
            f"{_mib(s.get('peak_memory_bytes'))} | {_ratio(s.get('peak_memory_bytes'), base.get('peak_memory_bytes'))} | "
            f"{_mib(m.get('weights'))} | {_mib(m.get('grads'))} | {_mib(m.get('optimizer_states'))} | "
            f"{_mib(m.get('activations'))} | {_ratio(m.get('activations'), bmem.get('activations'))} | "
            f"{s.get('comm_bytes_per_step', 0):.0f} |"
        )
    plot = out / "loss.png"
    if plot_losses({n: out / n / "metrics.jsonl" for n in results}, plot, "leantrain compare"):
        lines += ["", "![loss curves](loss.png)"]
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
