"""A one-line progress bar on stderr, for the demo and the benchmarks (no dependency)."""

from __future__ import annotations

import sys


def progress(label: str, step: int, total: int, width: int = 24) -> None:
    done = int(width * step / max(total, 1))
    end = "\n" if step >= total else ""
    bar = "#" * done + "." * (width - done)
    print(f"\r  {label:<40} [{bar}] {step}/{total}", end=end, file=sys.stderr, flush=True)
