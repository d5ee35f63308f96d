"""`pagedrag serve [MODEL] [flags]`: the OpenAI-compatible server.

Engine flags are generated from the EngineArgs dataclass (kebab-case, same
defaults; booleans get --x / --no-x), so they cannot drift from the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import socket
import types
import typing
from collections.abc import Callable
from pathlib import Path

from pagedrag.config import EngineArgs
from pagedrag.router.affinity import POLICIES, AffinityThresholds

logger = logging.getLogger("pagedrag")

# ServerConfig.max_request_bytes's default, repeated so that --help need not import the
# engine (a test keeps the two equal)
MAX_REQUEST_BYTES = 4 * 1024 * 1024
TEMPLATE_CHARACTERS = "{}\n"  # a --chat-template with none of these is a path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a model folder, a .gguf file, or a Hugging Face hub name (downloaded unless "
                             "HF_HUB_OFFLINE is set); default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="the model, as the positional argument (vLLM's other spelling)")
    engine = parser.add_argument_group("engine (pagedrag.EngineArgs)")
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        if field.name not in ("model", "served_model_name"):  # a positional; a server flag below
            _add_engine_flag(engine, field, hints[field.name])
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    server.add_argument("--port", type=_port, default=8000, help="(default: %(default)s)")
    server.add_argument("--api-key", action="append", type=_api_key, default=[], dest="api_keys", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* and /generate; repeat for several keys")
    server.add_argument("--salt-by-api-key", action="store_true",
                        help="give each API key its own prefix-cache salt (tenants never share blocks)")
    server.add_argument("--max-queue", type=positive_int, default=None,
                        help="answer 503 once this many requests are in flight (waiting + running)")
    server.add_argument("--served-model-name", nargs="+", default=None, dest="served_model_names",
                        metavar="NAME", help="model name(s) clients use (default: the model's own name)")
    server.add_argument("--max-request-bytes", type=positive_int, default=MAX_REQUEST_BYTES, metavar="N",
                        help="answer 413 to request bodies larger than N bytes, before parsing them "
                             "(default: %(default)s, 4 MiB)")
    server.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template (a file, or the template itself) used instead of "
                             "the model's own for /v1/chat/completions")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a chat template sent with a request (rendered in a sandboxed worker "
                             "with time and size limits); off by default, as in vLLM since its advisory "
                             "on client-supplied chat templates")
    server.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                        help="on SIGTERM or Ctrl-C, stop accepting requests and give those in flight "
                             "this long to finish; then end them (finish_reason \"abort\") and exit. "
                             "0 ends them at once; a second signal exits immediately "
                             "(default: %(default)g)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="uvicorn's log level (pagedrag's own: PAGEDRAG_LOG_LEVEL)")
    router = parser.add_argument_group("data parallel (pagedrag.router)")
    router.add_argument("--data-parallel-size", type=positive_int, default=1, metavar="N",
                        help="run N engine replicas (each a `pagedrag serve` process with the flags above) "
                             "behind one endpoint that routes by prefix-cache affinity (default: %(default)s)")
    router.add_argument("--router-policy", default="prefix_affinity", choices=POLICIES,
                        help="how requests are spread over the replicas (default: %(default)s)")
    router.add_argument("--router-cache-threshold", type=_share, default=AffinityThresholds.cache_threshold,
                        metavar="F", help="send a request to the replica holding its longest prefix when that "
                                          "covers at least this share of its blocks (default: %(default)s)")
    router.add_argument("--router-balance-abs-threshold", type=_non_negative_int,
                        default=AffinityThresholds.balance_abs_threshold, metavar="N",
                        help="route by load alone while the replicas' requests in flight differ by more "
                             "than N (default: %(default)s)")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return value


def _api_key(text: str) -> str:
    """A key that is not empty: an empty one (an unset variable in --api-key "$KEY") would be
    matched by requests that send no key."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): give a key, or leave --api-key out")
    return text


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], not {value}")
    return value


def _share(text: str) -> float:
    """A fraction in [0, 1] (NaN refused)."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1], not {text}")
    return value


def _seconds(text: str) -> float:
    """A duration >= 0 (NaN and infinity refused: the shutdown must be bounded)."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, not {text}")
    return value


def _add_engine_flag(group: argparse._ArgumentGroup, field: dataclasses.Field, hint) -> None:
    flag = "--" + field.name.replace("_", "-")
    kind = _base_type(hint)
    help_text = field.metadata.get("help", "")
    if "default" not in help_text:
        help_text += f" (default: {field.default})"
    if kind is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
    elif kind is dict:
        group.add_argument(flag, type=_json_value, default=field.default, metavar="JSON", help=help_text)
    else:
        group.add_argument(flag, type=_flag_value(hint, kind), default=field.default, help=help_text)


def _flag_value(hint, kind: type) -> Callable[[str], object]:
    """How a flag's text becomes the field's value: by ``kind``, and where the field's type
    allows them, "None" as None (``--seed None``: a random one) and "True" / "False" as those
    (``--hf-token True``: the saved login)."""
    allowed = set(typing.get_args(hint)) if isinstance(hint, types.UnionType) else {hint}
    words = {**({"none": None} if type(None) in allowed else {}),
             **({"true": True, "false": False} if bool in allowed and kind is not bool else {})}

    def parse(text: str):
        if text.lower() in words:
            return words[text.lower()]
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse


def _json_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None


def _base_type(hint) -> type:
    """int for ``int | None``; str for a union that holds it (``bool | str | None``: a command
    line gives text); the hint itself for a plain type."""
    if isinstance(hint, types.UnionType):
        kinds = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return str if str in kinds else kinds[0]
    return hint


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The engine's arguments: its flags, and the served names (they label its metrics)."""
    if getattr(args, "model_option", None) is not None:  # --model X: the positional's other spelling
        if args.model not in (None, args.model_option):
            raise ValueError(f"two models given: {args.model!r} and --model {args.model_option!r}")
        args.model, args.model_option = args.model_option, None
    names = EngineArgs.field_names() - {"served_model_name"}
    return EngineArgs(**{name: getattr(args, name) for name in names}, served_model_name=args.served_model_names)


def template_text(value: str | None) -> str | None:
    """--chat-template's text: the file it names, or the value itself (as vLLM reads it). A
    value with none of a template's characters ({, }, a newline) is a path, and one that names
    no file is a ValueError (as vLLM: it would otherwise be taken for a template of one line)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if not any(character in value for character in TEMPLATE_CHARACTERS):
        raise ValueError(f"--chat-template {value!r} looks like a file path, but no such file exists")
    return value


def server_config_from(args: argparse.Namespace, model_name: str):
    """The ServerConfig of the server flags; ``model_name`` is served when no
    --served-model-name is given."""
    from pagedrag.server.serving import ServerConfig

    return ServerConfig(served_model_names=args.served_model_names or [model_name],
                        api_keys=args.api_keys, max_queue=args.max_queue,
                        salt_by_api_key=args.salt_by_api_key,
                        max_request_bytes=args.max_request_bytes,
                        chat_template=template_text(args.chat_template),
                        trust_request_chat_template=args.trust_request_chat_template)


def check_can_listen(host: str, port: int) -> None:
    """OSError naming ``host``:``port`` unless a TCP socket can bind there now (an unknown
    host name, a port in use or not permitted)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as error:
        raise OSError(f"cannot listen on --host {host} --port {port}: {error}") from error


def freeze_startup_objects() -> None:
    """Collect garbage, then exempt every object alive now (the engine, the model's modules, the
    libraries imported: ~400k objects with the embedded model) from the garbage collector's full
    passes. Without this each full pass walks them all, every few thousand requests' worth of
    allocations: 200 ms on a 2-core EPYC, a stall of the step loop and of every request in
    flight. For a process that keeps its engine to the end (a server, a replica): frozen
    objects that later become cyclic garbage are never collected."""
    gc.collect()
    gc.freeze()


def run(args: argparse.Namespace) -> int:
    """Build the engine (its log line gives the KV pool), serve until SIGTERM or SIGINT.

    The first signal drains: no new connections, requests in flight get
    --shutdown-timeout seconds, then are aborted (finish_reason "abort"); run() then
    returns 0. A second signal ends the process at once (pagedrag.server.shutdown).
    """
    from pagedrag.entrypoints.async_engine import AsyncLLMEngine
    from pagedrag.server.app import build_app
    from pagedrag.server.shutdown import DrainingServer

    try:
        engine_args = engine_args_from(args)
        template_text(args.chat_template)
        check_can_listen(args.host, args.port)  # before the engine loads, which takes a while
    except (ValueError, OSError) as error:
        logger.error("%s", error)
        return 2
    if args.data_parallel_size > 1:
        from pagedrag.router.data_parallel import serve_replicas

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return serve_replicas(args, parser)
    try:
        engine = AsyncLLMEngine.from_engine_args(engine_args)
    except (ValueError, OSError) as error:  # a model that is not there, a KV budget that holds no block, ...
        logger.error("the engine could not start: %s", error, exc_info=logger.isEnabledFor(logging.DEBUG))
        return 1
    config = server_config_from(args, engine.model_info.name)
    logger.info("serving %s on http://%s:%d (API keys: %d, max queue: %s, shutdown timeout: %gs)",
                config.served_model_names, args.host, args.port, len(config.api_keys), config.max_queue,
                args.shutdown_timeout)
    server = DrainingServer(build_app(engine, config), engine, args.shutdown_timeout,
                            host=args.host, port=args.port, log_level=args.log_level)
    freeze_startup_objects()
    try:
        server.run()
    finally:
        with server.exiting():  # a signal while the engine stops exits at once
            engine.shutdown()
        gc.unfreeze()  # the interpreter's last collection sees everything again
    return 0
