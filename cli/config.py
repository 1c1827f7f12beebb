"""`--config=FILE.json`: a command's options read from a JSON file; options on the command line override it.

The file's values become click's default_map, so precedence is: command line > file > the options' defaults.
Each value is checked by its option's own type before the command runs, as the text the command line would give
it (so {"batch": 1.5}, {"batch": 2.0} and {"seed": true} are refused as --batch=1.5 and --seed=true are: Python
would read 1.5, 2.0 and true as the integers 1, 2 and 1), and an error names the file and key.
"""

from __future__ import annotations

from typing import Callable

import click

from edm2.runtime import bounded_json

CONFIG_PARAM = "config"
MAX_SHOWN = 10  # unknown keys named in the error line, which stays one line for a file of thousands


def config_option(translate: Callable[[dict, str], dict] | None = None, exclude: tuple[str, ...] = (),
                  expose: bool = False,
                  help: str = "Read options from a JSON file ({\"seeds\": \"0-63\", ...}); the command line "
                              "overrides it"):
    """An eager --config option; a file's keys are option names (without dashes) or parameter names, which
    translate(values, path) may map first (and drop keys the command derives itself). Keys naming no option, or
    one in exclude, are refused. With expose, the command receives the file's dict as `config`."""

    def load(ctx: click.Context, param: click.Parameter, path: str | None) -> dict | None:
        """Parse the file, check every value, and hand the values to click as defaults; returns the file's dict."""
        if path is None:
            return None
        values = read_config(path)
        params = translate(values, path) if translate else dict(values)
        ctx.default_map = {**(ctx.default_map or {}), **convert_values(ctx, params, path, exclude)}
        return values

    return click.option("--config", CONFIG_PARAM, metavar="FILE.json", is_eager=True, expose_value=expose,
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


def command_line_text(value: str | int | float | bool) -> str:
    """A JSON scalar as the command line would spell it (JSON's true and false as true and false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def convert_values(ctx: click.Context, values: dict, path: str, exclude: tuple[str, ...]) -> dict:
    """values (parameter name -> JSON value) converted by each option's type; null means the option's default."""
    params = {}
    for p in ctx.command.params:
        if p.name != CONFIG_PARAM and p.name not in exclude:
            params.update({key: p for key in [p.name, *(o[2:].replace("-", "_") for o in p.opts if o[:2] == "--")]})
    keys = {key: key.replace("-", "_") for key in values}
    unknown = sorted(key for key, name in keys.items() if name not in params)
    if unknown:
        shown = [k if k.isprintable() and len(k) <= 40 else repr(k[:40]) for k in unknown[:MAX_SHOWN]]
        more = f" and {len(unknown) - MAX_SHOWN} more" if len(unknown) > MAX_SHOWN else ""
        raise click.BadParameter(f"{path}: unknown key(s) {', '.join(shown)}{more}", param_hint="--config")
    owners: dict[str, list[str]] = {}
    for key, name in keys.items():
        owners.setdefault(params[name].name, []).append(key)
    same = next((k for k in owners.values() if len(k) > 1), None)
    if same:
        raise click.BadParameter(f"{path}: keys {', '.join(same)} set the same option", param_hint="--config")
    converted = {}
    for key, value in values.items():
        param = params[keys[key]]
        if value is None:
            continue
        if isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)):
            raise click.BadParameter(f"{path}: {key}: expected a value or a list of values", param_hint="--config")
        if param.multiple:  # a repeatable option: each element is one use of it
            text = [command_line_text(v) for v in (value if isinstance(value, list) else [value])]
        else:  # lists as on the command line
            text = ",".join(map(command_line_text, value)) if isinstance(value, list) else command_line_text(value)
        try:
            converted[param.name] = param.type_cast_value(ctx, text)
        except click.BadParameter as e:
            raise click.BadParameter(f"{path}: {key}: {e.message}", param_hint="--config") from None
    return converted
