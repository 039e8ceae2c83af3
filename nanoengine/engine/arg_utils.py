"""EngineArgs: the engine options as a plain dataclass (vLLM's name and place), with command-line flags.

Its fields are EngineConfig's, derived rather than listed twice; nothing is
validated or loaded until create_engine_config(). ``add_option_flags`` makes every
command line's option flags, ``nanoengine serve``'s included.
"""

import argparse
import json
import typing
from dataclasses import MISSING, Field, field, fields, make_dataclass

from nanoengine.config import EngineConfig

OPTIONS = [f for f in fields(EngineConfig) if f.init]


def add_option_flags(parser, options: list[Field], kind_of_option: str = "LLM option", given_only: bool = False,
                     shown_defaults: dict | None = None):
    """One ``--flag-name`` per dataclass field, on an argparse parser (or group); returns it. A bool is
    --flag / --no-flag, a dict is JSON, anything else the annotation's type without None. ``given_only``: a
    flag left out sets nothing, so the caller can tell the options given apart."""
    for option in options:
        kind = next(t for t in typing.get_args(option.type) or (option.type,) if t is not type(None))
        default = None if option.default is MISSING else option.default  # --model: EngineConfig checks it
        extra = ({"action": argparse.BooleanOptionalAction} if kind is bool
                 else {"type": json.loads, "metavar": "JSON"} if kind is dict else {"type": kind})
        shown = (shown_defaults or {}).get(option.name, default)
        parser.add_argument("--" + option.name.replace("_", "-"), default=argparse.SUPPRESS if given_only else default,
                            help=f"{kind_of_option} (default: {shown})", **extra)
    return parser


class EngineArgsMethods:
    def create_engine_config(self) -> EngineConfig:
        return EngineConfig(**vars(self))

    @classmethod
    def add_cli_args(cls, parser):
        """Add one ``--flag-name`` per option to an argparse parser (or group); returns it."""
        return add_option_flags(parser, OPTIONS)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{option.name: getattr(args, option.name) for option in OPTIONS})


EngineArgs = make_dataclass(
    "EngineArgs", [(f.name, f.type) if f.default is MISSING else (f.name, f.type, field(default=f.default))
                   for f in OPTIONS], bases=(EngineArgsMethods,))
EngineArgs.__module__ = __name__
