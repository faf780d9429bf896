"""``gpumesh-control`` entry point (reserved; not yet implemented)."""

from __future__ import annotations

import sys


def main() -> int:
    print(
        "error: gpumesh-control (the HTTP API and dashboard) is not available in this version "
        "of GPUMesh; use the gpumesh CLI",
        file=sys.stderr,
    )
    return 2
