"""``gpumesh-relay`` entry point (reserved; not yet implemented)."""

from __future__ import annotations

import sys


def main() -> int:
    print(
        "error: gpumesh-relay is not available in this version of GPUMesh; nodes must reach "
        "each other directly (forward UDP 47000 to the provider)",
        file=sys.stderr,
    )
    return 2
