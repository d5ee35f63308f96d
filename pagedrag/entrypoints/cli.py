"""`pagedrag serve | demo | bench | explain`: each subcommand lives in its own module,
which offers add_arguments(parser) and run(args) -> exit code."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

DESCRIPTION = ("pagedrag: a paged-attention LLM engine with prefix caching for RAG pipelines. "
               "Serve an OpenAI-compatible API, try the cache on a small RAG loop, benchmark it, "
               "or find out why two prompts do not share cached blocks.")
logger = logging.getLogger("pagedrag")
SUBCOMMANDS = {
    "serve": ("pagedrag.server.cli", "an OpenAI-compatible server with Prometheus /metrics"),
    "demo": ("pagedrag.entrypoints.demo", "a small RAG example with prefix-cache readouts"),
    "bench": ("pagedrag.entrypoints.bench", "a RAG-shaped throughput / TTFT benchmark"),
    "explain": ("pagedrag.rag.explain", "why two prompts do not share prefix-cache blocks"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from pagedrag import __version__, configure_logging

    configure_logging()
    parser = argparse.ArgumentParser(
        prog="pagedrag", description=DESCRIPTION,
        epilog="Run 'pagedrag COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"pagedrag {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    known, _ = parser.parse_known_args(argv[:1])
    module = importlib.import_module(SUBCOMMANDS[known.command][0])
    sub = argparse.ArgumentParser(prog=f"pagedrag {known.command}",
                                  description=SUBCOMMANDS[known.command][1])
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        return module.run(args)
    except (ValueError, OSError) as error:  # bad input met past parsing: a line, not a traceback
        logger.error("pagedrag %s: %s", known.command, error, exc_info=logger.isEnabledFor(logging.DEBUG))
        return 1


if __name__ == "__main__":
    sys.exit(main())
