"""``gpumesh-relay``: run a relay in the foreground.

Flags over the ``--config`` file over the defaults of
:class:`~gpumesh.relay.config.RelayConfig`. Every error is one ``error:``
line and a non-zero exit (2 for a bad setting, 1 when it cannot run);
tracebacks go to the debug log only. The server and its crypto are imported
only once the settings are known to be good, so ``--help`` stays fast.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import click

from gpumesh.errors import ConfigError
from gpumesh.relay.config import (
    DURATION_KEYS,
    INT_KEYS,
    SIZE_KEYS,
    RelayConfig,
    check_node_ids,
    load_config_file,
    parse_listen,
    parse_tcp,
    read_allow_file,
    read_token_file,
)
from gpumesh.relay.server import serve
from gpumesh.relay.tcp import TcpListenError
from gpumesh.servermain import print_error, run_command, stderr_logging
from gpumesh.units import parse_duration, parse_size
from gpumesh.version import __version__

__all__ = ["main", "relay"]

logger = logging.getLogger("gpumesh.relay")

EPILOG = """\b
Examples:
  gpumesh-relay --allow-file nodes.txt              # private: these node ids only
  gpumesh-relay --token-file token.txt              # private: nodes that know the token
  gpumesh-relay --open --listen 0.0.0.0:4799        # a public relay, anyone may register
  gpumesh-relay --config relay.toml --stats-file /run/gpumesh-relay.json
  gpumesh-relay --allow NODE_ID --session-bytes 50GB --session-rate 20MB
  gpumesh-relay --allow-file nodes.txt --tcp 0.0.0.0:443   # also over TLS, for UDP-less networks
\b
Sizes take units (10GB, 512MiB), durations seconds or units (45s, 2m, 24h).
Nodes use it with `gpumesh config set relay HOST:4799`. See docs/relay.md.
"""

_FILE = click.Path(dir_okay=False, path_type=Path)


@click.command(
    epilog=EPILOG,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--listen",
    metavar="HOST:PORT",
    help="UDP address to serve on (default 0.0.0.0:4799; port 0 picks a free one).",
)
@click.option(
    "--tcp",
    metavar="HOST:PORT",
    help="Also serve over TCP with TLS here, for nodes whose network blocks UDP "
    "(port 443 if none is given).",
)
@click.option(
    "--tls-cert",
    type=_FILE,
    help="PEM certificate for --tcp (default: a self-signed one made at start).",
)
@click.option("--tls-key", type=_FILE, help="PEM private key of --tls-cert.")
@click.option(
    "--allow",
    "allow",
    metavar="NODE_ID",
    multiple=True,
    help="A node id that may register (repeatable; see `gpumesh status` on the node).",
)
@click.option(
    "--allow-file", type=_FILE, help="Node ids that may register, one per line, # comments."
)
@click.option(
    "--token-file",
    type=_FILE,
    help="Shared token(s), one per line: nodes proving one may register.",
)
@click.option(
    "--open", "open_", is_flag=True, default=None, help="Serve any node (a public relay)."
)
@click.option("--config", "config_file", type=_FILE, help="TOML file with these settings as keys.")
@click.option(
    "--max-registrations",
    type=int,
    metavar="N",
    help="Registered addresses in all (default 10000).",
)
@click.option(
    "--max-per-ip", type=int, metavar="N", help="Registered addresses per source IP (default 32)."
)
@click.option(
    "--max-sessions",
    type=int,
    metavar="N",
    help="Relayed sessions per node, as either end (default 64).",
)
@click.option(
    "--max-sessions-initiated",
    type=int,
    metavar="N",
    help="Relayed sessions a node may have asked for at once (default 32).",
)
@click.option(
    "--max-sessions-per-pair",
    type=int,
    metavar="N",
    help="Relayed sessions from one node to one other (default 8; below --max-sessions).",
)
@click.option(
    "--keepalive", metavar="DURATION", help="Keep-alive interval asked of nodes (default 10s)."
)
@click.option(
    "--registration-timeout",
    metavar="DURATION",
    help="Drop a registration silent this long (default 45s).",
)
@click.option(
    "--connect-timeout",
    metavar="DURATION",
    help="Time a serving node has to accept a session (default 5s).",
)
@click.option(
    "--session-bytes",
    metavar="SIZE",
    help="Bytes relayed per session, both ways (default 10GB; 0: no cap).",
)
@click.option(
    "--session-seconds", metavar="DURATION", help="Session lifetime cap (default 24h; 0: none)."
)
@click.option(
    "--session-idle",
    metavar="DURATION",
    help="Close a session with no data this long (default 120s).",
)
@click.option(
    "--session-rate", metavar="SIZE", help="Bytes per second per session (default 0: unlimited)."
)
@click.option(
    "--queue",
    type=int,
    metavar="N",
    help="Packets queued per destination when sending blocks (default 256).",
)
@click.option(
    "--stats-file", type=_FILE, help="JSON counters, rewritten at most once a second and at exit."
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    help="Log level on stderr (default info).",
)
@click.version_option(__version__, "-V", "--version", prog_name="gpumesh-relay")
def relay(**options: Any) -> None:
    """Forward encrypted QUIC packets between GPUMesh nodes that cannot reach
    each other directly, and help them punch through NAT.

    Private by default: give --allow, --allow-file or --token-file (or --open).
    The relay sees who talks to whom and how much, never what they say.
    """
    config = build_config(options)
    stderr_logging(config.log_level)

    sys.exit(asyncio.run(_run(config)))


def build_config(options: dict[str, Any]) -> RelayConfig:
    """A checked :class:`RelayConfig` from the flags (None: not given) and ``--config``."""
    settings: dict[str, Any] = {}
    allow: set[str] = set()
    allow_files: list[Path] = []
    token_file: Path | None = None
    if options.get("config_file") is not None:
        from_file = load_config_file(options["config_file"])
        allow |= from_file.pop("allow", frozenset())
        if "allow_file" in from_file:
            allow_files.append(from_file.pop("allow_file"))
        token_file = from_file.pop("token_file", None)
        settings.update(from_file)
    if options.get("listen") is not None:
        settings["host"], settings["port"] = parse_listen(options["listen"])
    if options.get("tcp") is not None:
        settings["tcp_host"], settings["tcp_port"] = parse_tcp(options["tcp"])
    if options.get("allow"):
        allow |= check_node_ids(options["allow"], "--allow")
    if options.get("allow_file") is not None:
        allow_files.append(options["allow_file"])
    if options.get("token_file") is not None:
        token_file = options["token_file"]
    if options.get("open_"):
        settings["open"] = True
    for name in (*INT_KEYS, "stats_file", "tls_cert", "tls_key"):
        if options.get(name) is not None:
            settings[name] = options[name]
    for name in SIZE_KEYS:
        if options.get(name) is not None:
            settings[name] = _size_flag(options[name], name)
    for name in DURATION_KEYS:
        if options.get(name) is not None:
            settings[name] = parse_duration(options[name])
    if options.get("log_level") is not None:
        settings["log_level"] = options["log_level"].lower()
    for path in allow_files:
        allow |= read_allow_file(path)
    if allow:
        settings["allow"] = frozenset(allow)
    if token_file is not None:
        settings["tokens"] = read_token_file(token_file)
    return RelayConfig(**settings).check()


def _size_flag(text: str, name: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"--{name.replace('_', '-')}: {exc}") from None


async def _run(config: RelayConfig) -> int:
    try:
        server = await serve(config)
    except TcpListenError as exc:
        print_error(f"cannot listen on tcp {exc}")
        return 1
    except OSError as exc:
        where = f"{config.host}:{config.port}"
        print_error(f"cannot listen on udp {where}: {exc.strerror or exc}")
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    where = server.address_text
    if server.tcp_address_text:
        where += f" and tcp {server.tcp_address_text}"
    print(f"gpumesh-relay listening on {where} ({config.access_summary()})", flush=True)
    try:
        await stop.wait()
    finally:
        logger.info("shutting down: closing %d session(s)", server.core.session_count)
        server.close()
        await server.wait_closed()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point: the exit status (0, 1 cannot run, 2 bad settings)."""
    return run_command(relay, argv, "gpumesh-relay")


if __name__ == "__main__":
    sys.exit(main())
