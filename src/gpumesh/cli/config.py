"""``gpumesh config path|show|get|set|unset``"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import emit_json, get_node

if TYPE_CHECKING:
    from gpumesh.client.views.node import ConfigChangeView


@click.group(
    epilog="""\b
Examples:
  gpumesh config show
  gpumesh config get listen_port
  gpumesh config set listen_port 47001
  gpumesh config set max_vram 16GB
  gpumesh config get relay_token       # a secret: only `get` prints it
"""
)
def config() -> None:
    """Show or change this node's settings (config.toml in its home).

    `show` masks secret settings (relay_token); `get KEY` prints one as it is.
    """


@config.command()
def path() -> None:
    """Print the config file's path."""
    click.echo(get_node().home.config_path)


@config.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def show(as_json: bool) -> None:
    """Show every setting, its value and where it comes from.

    Secret settings show as ******** when set: `gpumesh config get KEY` prints one.
    """
    from gpumesh.store.config import KEYS, value_text

    cfg = get_node().home.config
    if as_json:
        emit_json(cfg.shown_all())
        return
    from gpumesh.cli._table import Column, escape, print_table

    rows = [
        [name, escape(value_text(cfg.shown(name))), escape(cfg.source(name)), escape(key.help)]
        for name, key in KEYS.items()
    ]
    # Values are never cut; on a narrow terminal the meaning goes under its key.
    columns = [Column("KEY"), Column("VALUE"), Column("FROM"), Column("MEANING", below=True)]
    print_table(columns, rows)


@config.command()
@click.argument("key")
def get(key: str) -> None:
    """Print one setting's effective value (a secret one too: you asked for it by name)."""
    from gpumesh.store.config import value_text

    click.echo(value_text(get_node().home.config.get(key)))


@config.command(name="set")
@click.argument("key")
@click.argument("value")
def set_(key: str, value: str) -> None:
    """Set KEY to VALUE (validated; unknown keys are refused; a secret is not echoed)."""
    view = _change(key, value)
    click.echo(f"{key} = {view.value}" + (" (hidden)" if view.secret else ""))
    if key in _READ_WHEN_SHARING_STARTS and view.sharing:
        click.echo(
            f"The running `gpumesh share` read {key} when it started: restart it "
            "(`gpumesh share stop`, then `gpumesh share ...`) for this to take effect."
        )


# What `gpumesh share` reads once, at start, for the public registry.
_READ_WHEN_SHARING_STARTS = ("announce_addresses", "rendezvous_url", "region")


@config.command()
@click.argument("key")
def unset(key: str) -> None:
    """Return KEY to its default."""
    click.echo(f"{key} = {_change(key, None).value} (default)")


def _change(key: str, value: str | None) -> ConfigChangeView:
    """Set ``key`` (unset it: ``value`` None): through the node process when one runs
    this home, so a running share sees it at once; else in the file."""
    from urllib.parse import quote

    from gpumesh.client.bodies import ConfigBody
    from gpumesh.client.views.node import ConfigChangeView
    from gpumesh.daemon.client import NodeClient
    from gpumesh.daemon.record import holder

    home = get_node().home
    if holder(home.path) is not None:
        path, client = f"/api/v1/config/{quote(key, safe='')}", NodeClient(home.path)
        if value is None:
            return client.call("DELETE", path, ConfigChangeView)
        return client.call("PUT", path, ConfigChangeView, ConfigBody(value=value))
    config = home.config
    if value is None:
        config.unset(key)
    else:
        config.set(key, value)
    config.save()
    return ConfigChangeView.of(home, key)
