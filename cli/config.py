"""`--config=FILE.json`: a command's options read from a JSON file; options on the command line override it.

The file's values become click's default_map, so precedence is: command line > file > the options' defaults.
Each value is checked by its option's own type before the command runs, and an error names the file and key.
"""

from __future__ import annotations

from typing import Callable

import click

from edm2 import bounded_json

CONFIG_PARAM = "config"


def config_option(translate: Callable[[dict, str], dict] | None = None, exclude: tuple[str, ...] = (),
                  help: str = "Read options from this JSON file; options on the command line override it"):
    """An eager --config option; translate(values, path) maps a file's keys to parameter names first (it may
    also drop keys the command derives itself). Keys naming no parameter, or one in exclude, are refused."""

    def load(ctx: click.Context, param: click.Parameter, path: str | None) -> dict | None:
        """Parse the file, check every value, and hand the values to click as defaults; returns the file's dict."""
        if path is None:
            return None
        values = read_config(path)
        params = translate(values, path) if translate else dict(values)
        ctx.default_map = {**(ctx.default_map or {}), **convert_values(ctx, params, path, exclude)}
        return values

    return click.option("--config", CONFIG_PARAM, metavar="FILE.json", is_eager=True, expose_value=True,
                        callback=load, help=help)


def read_config(path: str) -> dict:
    """The JSON object in path, read with bounded_json; anything else is refused naming --config."""
    try:
        values = bounded_json.read(path)
    except OSError as e:
        raise click.BadParameter(f"{path}: {e.strerror or e}", param_hint="--config") from None
    except bounded_json.JSONFileError as e:
        raise click.BadParameter(str(e), param_hint="--config") from None
    if not isinstance(values, dict):
        raise click.BadParameter(f"{path}: expected a JSON object of options, found {type(values).__name__}",
                                 param_hint="--config")
    return values


def convert_values(ctx: click.Context, values: dict, path: str, exclude: tuple[str, ...]) -> dict:
    """values (parameter name -> JSON value) converted by each option's type; null means the option's default."""
    params = {p.name: p for p in ctx.command.params if p.name != CONFIG_PARAM and p.name not in exclude}
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise click.BadParameter(f"{path}: unknown key(s) {', '.join(unknown)}", param_hint="--config")
    converted = {}
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)):
            raise click.BadParameter(f"{path}: {name}: expected a value or a list of values", param_hint="--config")
        text = ",".join(str(v) for v in value) if isinstance(value, list) else value  # lists as on the command line
        try:
            converted[name] = params[name].type_cast_value(ctx, text)
        except click.BadParameter as e:
            raise click.BadParameter(f"{path}: {name}: {e.message}", param_hint="--config") from None
    return converted
