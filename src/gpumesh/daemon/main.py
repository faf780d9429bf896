"""``gpumesh-control``: this home's control API, on its unix socket and on TCP.

Serves ``$GPUMESH_HOME/control.sock`` (the owner's) and ``GPUMESH_API_ADDR``
(default ``127.0.0.1:8080``) together in one event loop until SIGINT or SIGTERM,
then exits 0. A bind beyond loopback needs ``--allow-remote``, a
``$GPUMESH_API_TOKEN`` of at least 32 characters and ``--tls-cert``/``--tls-key``
(it is served over HTTPS only). It is this home's node process in the
foreground (:mod:`gpumesh.daemon.process`): a node process a command started in
the background hands over to it. While this home's ``gpumesh share`` runs, the API
works beside it: it reads the same store, and the owner's changes (a deny, a
cancel) reach the agent through its notification socket.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import click

from gpumesh.daemon.process import run_node
from gpumesh.errors import GPUMeshError
from gpumesh.servermain import run_command
from gpumesh.settings import (
    API_ADDR_DEFAULT,
    ENV_API_ADDR,
    ENV_API_HOSTS,
    ENV_API_TOKEN,
    ENV_LOG,
    env,
)
from gpumesh.version import __version__

__all__ = ["command", "main"]


def _hosts(text: str | None) -> list[str]:
    return [name.strip().lower() for name in (text or "").split(",") if name.strip()]


@click.command(
    name="gpumesh-control",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="""\b
Examples:
  gpumesh-control                                  # unix socket + 127.0.0.1:8080
  GPUMESH_API_ADDR=127.0.0.1:9090 gpumesh-control
  curl --unix-socket ~/.gpumesh/control.sock http://gpumesh/api/v1/status
  # over TCP, in bash: printf is built in, so the token is on no command line
  curl -H @<(printf 'Authorization: Bearer %s\\n' "$(<~/.gpumesh/api.token)") \\
      http://127.0.0.1:8080/api/v1/peers
  GPUMESH_API_TOKEN=$(openssl rand -hex 16) gpumesh-control --listen 10.0.0.5:8443 \\
      --allow-remote --tls-cert cert.pem --tls-key key.pem --allowed-host gpu-box.lan
""",
)
@click.option(
    "--listen",
    envvar=ENV_API_ADDR,
    show_envvar=True,
    default=API_ADDR_DEFAULT,
    show_default=True,
    metavar="HOST:PORT",
    help="TCP address to serve on (loopback unless --allow-remote).",
)
@click.option(
    "--allow-remote",
    is_flag=True,
    help=f"Allow a bind beyond loopback (needs --tls-cert, --tls-key and a ${ENV_API_TOKEN} "
    "of at least 32 characters).",
)
@click.option(
    "--tls-cert",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="PEM certificate to serve TCP over HTTPS with.",
)
@click.option(
    "--tls-key",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="PEM private key of --tls-cert.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help=f"A name browsers may use in Host besides loopback (also ${ENV_API_HOSTS}).",
)
@click.option("--no-tcp", is_flag=True, help="Serve the unix socket only.")
@click.version_option(__version__, "-V", "--version", prog_name="gpumesh-control")
def command(
    listen: str,
    allow_remote: bool,
    tls_cert: Path | None,
    tls_key: Path | None,
    allowed_hosts: tuple[str, ...],
    no_tcp: bool,
) -> None:
    """Serve this node's control API (HTTP/JSON, /api/v1, OpenAPI at
    /api/v1/openapi.json) on $GPUMESH_HOME/control.sock and on TCP.

    The unix socket is the owner's (mode 0600) and needs no credential. TCP
    always does: `Authorization: Bearer TOKEN` with $GPUMESH_API_TOKEN, or the
    home's own random token in api.token (0600, made on first use); a browser
    opens the one-time login URL printed here. Stop with Ctrl-C or SIGTERM.
    """

    if (tls_cert is None) != (tls_key is None):
        click.echo("error: --tls-cert and --tls-key go together: give both", err=True)
        raise SystemExit(2)
    try:
        code = asyncio.run(
            run_node(
                None,
                listen=None if no_tcp else listen,
                allow_remote=allow_remote,
                tls=None if tls_cert is None or tls_key is None else (tls_cert, tls_key),
                hosts=[*_hosts(env(ENV_API_HOSTS)), *_hosts(",".join(allowed_hosts))],
                detached=False,
                announce=lambda line: print(line, flush=True),
            )
        )
    except GPUMeshError as exc:
        click.echo(f"error: {exc.message}", err=True)
        raise SystemExit(int(exc.exit_code)) from None
    raise SystemExit(code)


def setup_logging() -> None:
    """Warnings (or ``$GPUMESH_LOG``'s level) to stderr, one line each."""

    level = (env(ENV_LOG) or "warning").split(",")[0].upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("gpumesh")
    root.addHandler(handler)
    root.setLevel(level if level in logging.getLevelNamesMapping() else "WARNING")


def main(argv: list[str] | None = None) -> int:
    """Console entry point: the exit status, every failure as one line."""
    setup_logging()
    return run_command(command, argv, "gpumesh-control")
