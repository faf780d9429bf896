"""``python -m gpumesh.daemon``: the node process (what a command starts in the
background; ``gpumesh-control`` is the same process in the foreground, serving TCP too)."""

from __future__ import annotations

import asyncio
import sys

from gpumesh.daemon.client import start_failure_line
from gpumesh.daemon.main import setup_logging
from gpumesh.daemon.process import run_node
from gpumesh.errors import GPUMeshError


def main() -> int:
    setup_logging()
    detached = "--detached" in sys.argv[1:]
    try:
        return asyncio.run(
            run_node(
                None,
                listen=None,
                allow_remote=False,
                hosts=[],
                detached=detached,
                announce=lambda line: print(line, flush=True),
            )
        )
    except GPUMeshError as exc:
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        if detached:  # for the command that started it, which reads its log
            print(start_failure_line(exc), file=sys.stderr, flush=True)
        return int(exc.exit_code)


if __name__ == "__main__":
    sys.exit(main())
