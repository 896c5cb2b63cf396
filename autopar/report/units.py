"""Byte, time and FLOP quantities as people write them ("80GB", "512MiB", "412 ms")."""
from __future__ import annotations

import math
import re

# Decimal units are powers of 1000 (as disk and GPU vendors count: an "80GB" H100 has 80e9+ bytes);
# binary units are powers of 1024 (GiB = 2**30).
_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> float:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '512MB' -> 512e6, '1000' -> 1000 bytes."""
    m = _BYTES_RE.match(text)
    if m is None:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 80GB (10^9 bytes), 80GiB (2^30 bytes), 512MB or a plain number of bytes")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return value


def fmt_bytes(n: float | None, up: bool = False) -> str:
    """Binary units (GiB), the unit device memory is reported in by nvidia-smi and torch.cuda. `up`: rounded up,
    for a need the user may pass back as a budget."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{math.ceil(n / size * 100 - 1e-9) / 100 if up else n / size:.2f} {unit}"
    return f"{math.ceil(n) if up else n:.0f} B"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if abs(s) >= 1:
        return f"{s:.2f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def fmt_signed_bytes(n: float) -> str:
    return ("+" if n >= -1e-6 else "-") + fmt_bytes(abs(n))  # float noise around 0 prints as +0


def fmt_signed_seconds(s: float) -> str:
    return ("+" if s >= -1e-12 else "-") + fmt_seconds(abs(s))
