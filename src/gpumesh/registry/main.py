"""``gpumesh-registry``: serve the public registry in the foreground.

Every error is one ``error:`` line and a non-zero exit (2 for a bad setting,
1 when it cannot run); tracebacks go to the debug log only. The socket is
bound before the server starts, so a taken port is said in one line that
names ``--listen``. Every connection passes :mod:`gpumesh.httpguard` (caps per
address and in total, a deadline for a whole request, the body limit), with
``$GPUMESH_HTTP_DEADLINE``, ``$GPUMESH_HTTP_CONNECTIONS`` and
``$GPUMESH_HTTP_PER_CLIENT`` over its defaults; the trusted proxies of
``--forwarded-allow-ips`` carry many clients and have no per-address cap.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
from typing import Any

import click
import uvicorn

from gpumesh.errors import ConfigError
from gpumesh.httpguard import Guard, Limits, http_protocol, raise_descriptor_limit
from gpumesh.protocol.addresses import format_address
from gpumesh.registry.app import create_app
from gpumesh.registry.config import (
    DEFAULT_DB,
    DEFAULT_LISTEN,
    RegistryConfig,
    database_url,
    trusted_proxies,
)
from gpumesh.registry.store import RegistryStore
from gpumesh.servermain import print_error, run_command, stderr_logging
from gpumesh.version import __version__

__all__ = ["main", "registry"]

logger = logging.getLogger("gpumesh.registry")

EPILOG = """\b
Examples:
  gpumesh-registry                                   # 0.0.0.0:47080, ./gpumesh-registry.db
  gpumesh-registry --listen 127.0.0.1:8090 --db /var/lib/gpumesh/registry.db
  gpumesh-registry --db postgresql://gpumesh:secret@db.example.org/registry
  gpumesh-registry --forwarded-allow-ips 127.0.0.1   # behind a TLS reverse proxy
\b
Nodes use it with `gpumesh config set rendezvous_url http://HOST:47080`.
A listing grants nothing: users still pair before they run. See docs/registry.md.
"""


@click.command(
    epilog=EPILOG,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--listen",
    metavar="HOST:PORT",
    default=DEFAULT_LISTEN,
    show_default=True,
    help="TCP address to serve HTTP on (port 0 picks a free one).",
)
@click.option(
    "--db",
    metavar="PATH|URL",
    default=DEFAULT_DB,
    show_default=True,
    help="SQLite file, or postgresql://user:password@host/database.",
)
@click.option(
    "--ttl",
    type=float,
    default=900.0,
    show_default=True,
    help="Seconds a listing lives without a refresh.",
)
@click.option(
    "--publish-per-key",
    type=int,
    default=10,
    show_default=True,
    help="Records per minute from one node key (0: no limit).",
)
@click.option(
    "--publish-per-ip",
    type=int,
    default=30,
    show_default=True,
    help="Records per minute from one source address, or IPv6 /64 (0: no limit).",
)
@click.option(
    "--search-per-ip",
    type=int,
    default=240,
    show_default=True,
    help="Searches per minute from one source address (0: no limit).",
)
@click.option(
    "--listings-per-net",
    type=int,
    default=3,
    show_default=True,
    help="Live listings from one /24 (IPv4) or /64 (IPv6) (0: no cap).",
)
@click.option(
    "--page-per-net",
    type=int,
    default=2,
    show_default=True,
    help="Listings of one such network on a page of results (0: no cap).",
)
@click.option(
    "--forwarded-allow-ips",
    metavar="IPS",
    default="",
    help="Addresses or networks of the reverse proxies whose X-Forwarded-For names the "
    "client (comma-separated; '*' is refused: clients could choose their address).",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
    help="Log level on stderr.",
)
@click.version_option(__version__, "-V", "--version", prog_name="gpumesh-registry")
def registry(**options: Any) -> None:
    """Serve signed GPU listings and address records of GPUMesh nodes.

    Nodes publish with `gpumesh share --public`; people find them with
    `gpumesh search`, and paired peers find each other's new addresses with
    `gpumesh sync`. Every record is signed by its node; search results are
    checked by the client, so the registry cannot forge one.
    """
    try:
        host, port = _parse_listen(options["listen"])
    except ValueError:
        raise ConfigError(
            f"invalid --listen {options['listen']!r}: use HOST:PORT, e.g. 0.0.0.0:47080"
        ) from None
    config = RegistryConfig(
        db=options["db"],
        ttl=options["ttl"],
        publish_per_key=options["publish_per_key"],
        publish_per_ip=options["publish_per_ip"],
        search_per_ip=options["search_per_ip"],
        listings_per_net=options["listings_per_net"],
        page_per_net=options["page_per_net"],
    ).check()
    forwarded = trusted_proxies(options["forwarded_allow_ips"])
    url = database_url(config.db)
    stderr_logging(options["log_level"])
    try:
        import sqlalchemy  # noqa: F401
    except ImportError:
        raise click.ClickException(
            "gpumesh-registry needs its database drivers: pip install 'gpumesh[registry]'"
        ) from None
    sock = _bind(host, port)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        status = runner.run(_run(config, url, sock, forwarded, options["log_level"]))
    sys.exit(status)


def _parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[v6]:PORT``; port 0 picks a free one."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(text)
    return host, int(port)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle off only on sockets that say
    # so, and with Nagle a kept-alive client waits ~40 ms for every response
    # (its delayed ACK of the headers holds back the body).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        where = format_address((host, port))
        if exc.errno == errno.EADDRINUSE:
            raise click.ClickException(
                f"cannot listen on {where}: the port is taken (another process, perhaps a "
                "GPUMesh dashboard, listens there); choose another with --listen HOST:PORT"
            ) from None
        raise click.ClickException(
            f"cannot listen on {where}: {exc.strerror or exc}; choose another with --listen"
        ) from None
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def _loop_factory() -> Any:
    """uvloop's event loop when it is installed (the registry extra brings it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _run(
    config: RegistryConfig, url: str, sock: socket.socket, forwarded: str, log_level: str
) -> int:
    store = RegistryStore(url)
    where = config.db if "://" not in config.db else config.db.split("@")[-1]
    try:
        await store.open()
    except Exception as exc:
        logger.debug("opening the database failed", exc_info=True)
        await store.close()
        print_error(f"cannot open the database {where}: {_reason(exc)}; check --db")
        return 1
    app = create_app(config, store, open_store=False)
    host, port = sock.getsockname()[:2]
    print(
        f"gpumesh-registry listening on http://{format_address((host, port))} (database: {where})",
        flush=True,
    )
    logger.info("serving with the %s event loop and %s", _loop_name(), _http_name())
    proxies = frozenset(p.strip() for p in forwarded.split(",") if p.strip() not in ("", "*"))
    limits = Limits.from_env(body=config.max_body, exempt=proxies)
    guard = Guard(limits.fitted(raise_descriptor_limit()))
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            http=http_protocol(guard),
            log_level=log_level.lower(),
            access_log=False,
            proxy_headers=bool(forwarded),
            forwarded_allow_ips=forwarded or None,
            lifespan="on",
        )
    )
    try:
        await server.serve(sockets=[sock])
    finally:
        await store.close()
    return 0 if server.started else 1


def _loop_name() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def _http_name() -> str:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Console entry point: the exit status (0, 1 cannot run, 2 bad settings)."""
    return run_command(registry, argv, "gpumesh-registry")


if __name__ == "__main__":
    sys.exit(main())
