"""The Ray Serve application's arguments (``serve run ... key=value`` strings, or typed values of
a config file) as a `pagedrag serve` command line, by the kind of each flag.

- ``model``: the positional argument; ``None`` (YAML ``null``): the flag's default, left out;
- on/off flags: ``true`` / ``false`` (a switch with no ``--no-`` form: false is its default);
- several-value flags (``served_model_name: [a, b]``): one flag with every value; repeated
  ones (``api_key: [k1, k2]``): the flag once per value;
- a JSON flag (``speculative_config``): a mapping, or its JSON text.

Flags of `pagedrag serve`'s own HTTP server (``host``, ``port``, ...) do nothing on Ray,
where Ray Serve's HTTP proxy listens and Ray starts the replicas: they are refused by name.
"""

from __future__ import annotations

import argparse
import json

NOT_ON_RAY = {"host": "Ray Serve's http_options", "port": "Ray Serve's http_options",
              "data_parallel_size": "num_replicas", "shutdown_timeout": "Ray Serve's graceful_shutdown_timeout_s",
              "log_level": "Ray's logging_config"}


def serve_argv(settings: dict, parser: argparse.ArgumentParser) -> list[str]:
    """`pagedrag serve` arguments for ``settings`` (``parser``: that command's); ValueError for
    a setting that is not one of its flags or does nothing on Ray."""
    actions = _actions_by_setting(parser)
    argv: list[str] = []
    for key, value in settings.items():
        if key in NOT_ON_RAY:
            raise ValueError(f"{key!r} does nothing on Ray Serve (use {NOT_ON_RAY[key]})")
        if value is None:
            continue
        if key == "model":
            argv.insert(0, str(value))
            continue
        if key not in actions:
            raise ValueError(f"unknown setting {key!r}: not a `pagedrag serve` flag (without dashes), "
                             "nor num_replicas, num_gpus or num_cpus")
        argv += flag_arguments(actions[key], value)
    return argv


def _actions_by_setting(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each flag's action by its setting name: the long option without dashes (``api_key``)."""
    return {option[2:].replace("-", "_"): action for action in parser._actions  # noqa: SLF001
            for option in action.option_strings[:1] if option.startswith("--")}


def flag_arguments(action: argparse.Action, value) -> list[str]:
    """The command-line arguments that give option ``action`` the value ``value`` (the Ray
    settings' and the data-parallel replicas' command lines are made with it)."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        on = _truthy(flag, value)
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if on else action.option_strings[1]]
        return [flag] if on else []  # a switch: off is its default
    if isinstance(value, dict):  # a JSON flag: its text, not Python's repr
        return [flag, json.dumps(value)]
    values = value if isinstance(value, list) else [value]
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001 - repeated: the flag per value
        return [item for entry in values for item in (flag, str(entry))]
    if action.nargs in ("+", "*"):
        return [flag, *map(str, values)]
    if isinstance(value, list):
        raise ValueError(f"{flag[2:].replace('-', '_')!r} takes one value, got a list: {value!r}")
    return [flag, str(value)]


def _truthy(flag: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ValueError(f"{flag[2:].replace('-', '_')!r} is on or off: true or false, got {value!r}")
