"""EngineArgs: the engine options as a plain dataclass (vLLM's name and place), with command-line flags.

Its fields are EngineConfig's, derived rather than listed twice; nothing is
validated or loaded until create_engine_config().
"""

import argparse
import json
import typing
from dataclasses import MISSING, field, fields, make_dataclass

from nanoengine.config import EngineConfig

OPTIONS = [f for f in fields(EngineConfig) if f.init]


class EngineArgsMethods:
    def create_engine_config(self) -> EngineConfig:
        return EngineConfig(**vars(self))

    @classmethod
    def add_cli_args(cls, parser):
        """Add one ``--flag-name`` per option to an argparse parser (or group); returns it."""
        for option in OPTIONS:
            flag = "--" + option.name.replace("_", "-")
            if option.type is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=option.default)
            else:  # the annotation's non-None type: int | None -> int (a dict is given as JSON)
                kind = next(t for t in typing.get_args(option.type) or (option.type,) if t is not type(None))
                default = None if option.default is MISSING else option.default  # --model: EngineConfig checks it
                parser.add_argument(flag, type=json.loads if kind is dict else kind, default=default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{option.name: getattr(args, option.name) for option in OPTIONS})


EngineArgs = make_dataclass(
    "EngineArgs", [(f.name, f.type) if f.default is MISSING else (f.name, f.type, field(default=f.default))
                   for f in OPTIONS], bases=(EngineArgsMethods,))
EngineArgs.__module__ = __name__
