"""The `longreach` command line: the entry point, which assembles the parser from the command modules and runs one.

  longreach generate   complete a prompt (or answer a chat message) with a model
  longreach serve      an OpenAI-compatible HTTP server over the engine
  longreach backends   list the attention backends

Each command lives in a module next to the code it drives, with HELP, DESCRIPTION, add_arguments(parser) and
main(args) -> int (`_COMMANDS`): the engine's own (commands/, server/, models/) and the lab's (tools/: bench, eval,
calibrate, demo). Bad input exits with status 2 and a one-line message on stderr, never a traceback; so does a command
whose install extra is missing (`_EXTRAS`), with the pip command that brings it.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from . import __version__

_COMMANDS = {  # command -> its module (relative to this package), in the order --help lists them
    "generate": ".commands.generate",
    "serve": ".server.command",
    "bench": ".tools.bench.command",
    "eval": ".tools.eval.command",
    "demo": ".tools.demo",
    "calibrate": ".tools.calibrate",
    "download": ".models.hub",
    "backends": ".commands.backends",
}
_EXTRAS = {  # pyproject.toml's install extras -> the modules each brings (import names)
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
    "eval": ("matplotlib", "wonderwords", "scipy", "yaml"),
    "bench": ("transformers", "accelerate"),  # `bench engine`'s reference
}
# the extras' modules a command imports on every run: looked up before it runs, so that a missing extra fails at once
# rather than at the plot after an hour's run; any other module of an extra is named when its import fails
_NEEDS = {"serve": _EXTRAS["serve"], "eval": ("matplotlib",), "demo": ("wonderwords", "yaml")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longreach",
        description="longreach: million-token inference for pretrained Llama-family models on one GPU.")
    parser.add_argument("--version", action="version", version=f"longreach {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors in the log")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug log (one line per engine step)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, path in _COMMANDS.items():
        mod = importlib.import_module(path, __package__)
        p = sub.add_parser(name, help=mod.HELP, description=mod.DESCRIPTION)
        mod.add_arguments(p)
        p.set_defaults(func=mod.main)
    return parser


def _stack_dumps_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr and the run goes on: where a long run is
    (scripts/device_runs.sh sends it when a command outlives its time, before killing it)."""
    import faulthandler
    import signal

    if not hasattr(signal, "SIGUSR1"):
        return
    for stream in (sys.stderr, sys.__stderr__):  # a stderr without a file descriptor (captured): the process's own
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is an OSError and a ValueError
            continue


def _parse_json_configs(args: argparse.Namespace) -> None:
    """--attention-config and --decode-attention-config arrive as JSON text: parsed here, once, into the dicts that
    every command passes on (ValueError says what was wrong)."""
    from .config import config_dict

    for name in ("attention_config", "decode_attention_config"):
        if isinstance(getattr(args, name, None), str):
            setattr(args, name, config_dict(getattr(args, name), name))


def _missing_extra(module: str) -> str | None:
    """The one-line error for a module of an install extra that is not installed; None for any other module."""
    top = module.partition(".")[0]
    for extra, modules in _EXTRAS.items():
        if top in modules:
            return f'{top} is not installed; it comes with the [{extra}] extra: pip install "longreach[{extra}]"'
    return None


def _check_extras(command: str) -> None:
    """Raise ValueError naming the first module of an extra that `command` needs and this Python lacks (found without
    importing it)."""
    import importlib.util

    for module in _NEEDS.get(command, ()):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken install, or a module set to None in sys.modules
            found = False
        if not found:
            raise ValueError(_missing_extra(module))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for reports
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="[longreach] %(message)s", stream=sys.stderr)
    _stack_dumps_on_sigusr1()
    try:
        _check_extras(args.command)
        _parse_json_configs(args)
        return args.func(args)
    except ValueError as e:
        print(f"longreach {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an extra's module imported by a command that does not declare the extra
        message = _missing_extra(e.name or "")
        if message is None:
            raise
        print(f"longreach {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("longreach: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
