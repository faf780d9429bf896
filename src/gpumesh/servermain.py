"""What the standalone servers' entry points share (``gpumesh-relay``,
``gpumesh-registry``): their stderr logging, their one-line errors, and the
mapping of every failure to an exit status without a traceback."""

from __future__ import annotations

import logging
import sys

import click

from gpumesh.errors import ConfigError

__all__ = ["print_error", "run_command", "stderr_logging"]


def stderr_logging(level: str) -> None:
    """Log the package at ``level`` (a name: info, debug...) to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger("gpumesh")
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


def print_error(message: str) -> None:
    """``error: message`` on stderr (in red on a terminal)."""
    prefix = click.style("error:", fg="red", bold=True) if sys.stderr.isatty() else "error:"
    click.echo(f"{prefix} {message}", err=True)


def run_command(command: click.Command, argv: list[str] | None, prog_name: str) -> int:
    """Run a server's click command; the exit status (0, 1 cannot run, 2 bad
    settings, 130 interrupted), every failure as one line, never a traceback."""
    try:
        result = command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except ConfigError as exc:
        print_error(exc.message)
        return 2
    except click.ClickException as exc:  # a usage error's exit_code is 2
        print_error(exc.format_message())
        return exc.exit_code
    except (click.Abort, KeyboardInterrupt):
        return 130
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    except Exception as exc:  # never a traceback on the terminal
        logging.getLogger("gpumesh").debug("%s failed", prog_name, exc_info=True)
        print_error(f"{type(exc).__name__}: {exc}")
        return 1
    return result if isinstance(result, int) else 0
