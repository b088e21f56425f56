"""The one configuration mechanism: a service's dataclass filled from flags named after its fields and from
``SPLITSERVE_*`` environment variables.

Field ``max_num_seqs`` of a service's dataclass becomes flag ``--max-num-seqs`` and environment variable
``SPLITSERVE_MAX_NUM_SEQS``. Precedence: flag, then environment, then the dataclass default. Booleans accept
``--flag`` / ``--no-flag`` and ``true/false/1/0`` in the environment; list fields take comma-separated values
(on the command line also space-separated: ``--goodput ttft:500 tpot:100``);
``enum.StrEnum`` fields take one of their values (listed in ``--help``). The Helm chart
(``deploy/helm/splitserve``) maps its values to these flags and nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import textwrap
import typing
from typing import Any, Mapping, TypeVar

T = TypeVar("T")
ENV_PREFIX = "SPLITSERVE_"
PASSED_TO = "passed_to"  # field metadata: the config classes a field is handed on to (``passed_to``)
PASSED_AS = "passed_as"  # field metadata: the name of the field it is handed on to
PASSED_SCOPE = "passed_scope"  # field metadata: handed on only to the processes of this scope (a pod role)


def described(text: str) -> dict[str, str]:
    """Field metadata carrying the flag's help text: ``field(default=1, metadata=described("..."))``."""
    return {"help": text}


def passed_to(*configs: type, name: str, help: str | None = None, scope: str | None = None) -> Any:
    """A field of a config that starts other processes (``splitserve up``'s ``UpConfig``) which is field ``name`` of
    each of ``configs`` and is handed to them as its flag: the default and the help come from the first of them
    (``help`` replaces the text), and ``passed_on(config, cls)`` lists the flags for a process configured by ``cls``.
    With a ``scope`` (a pod role), the field goes only to the processes of that scope, as their ``name``: so
    ``prefill_quantization`` and ``decode_quantization`` both become the pods' ``--quantization``."""
    source = next((f for f in dataclasses.fields(configs[0]) if f.name == name), None)
    if source is None:
        raise TypeError(f"{configs[0].__name__} has no field {name!r}")
    default = ({"default": source.default} if source.default is not dataclasses.MISSING
               else {"default_factory": source.default_factory})
    return dataclasses.field(**default, metadata={"help": help or source.metadata.get("help", ""),
                                                  PASSED_TO: configs, PASSED_AS: name, PASSED_SCOPE: scope})


def passed_values(config: Any, cls: type, scope: str | None = None) -> dict[str, Any]:
    """The fields of ``config`` declared ``passed_to`` ``cls`` or one of its bases (and, those with a scope, to
    ``scope``), under the names ``cls`` gives them, with ``config``'s values: the keyword arguments of a ``cls``
    built in this process."""
    return {f.metadata[PASSED_AS]: getattr(config, f.name) for f in dataclasses.fields(config)
            if any(issubclass(cls, target) for target in f.metadata.get(PASSED_TO, ()))
            and f.metadata[PASSED_SCOPE] in (None, scope)}


def passed_on(config: Any, cls: type, scope: str | None = None) -> list[str]:
    """``passed_values(config, cls, scope)`` as flags, for a process configured by ``cls``."""
    flags: list[str] = []
    for name, value in passed_values(config, cls, scope).items():
        if isinstance(value, bool):
            flags.append(flag_name(name if value else f"no_{name}"))
        else:
            flags += [flag_name(name), ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return flags


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def parse_config(cls: type[T], argv: list[str] | None = None, env: Mapping[str, str] | None = None,
                 prog: str | None = None, epilog: str | None = None) -> T:
    """Build ``cls`` from ``argv`` and ``env`` (os.environ by default). Bad values exit with a usage error.
    ``--help`` says the first paragraph of ``cls``'s docstring, then every flag, then ``epilog`` (examples) as
    written."""
    env = os.environ if env is None else env
    summary = textwrap.fill(" ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()), width=100)
    parser = argparse.ArgumentParser(prog=prog, description=summary, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        _add_flag(parser, f, hints[f.name])
    args = parser.parse_args(argv or [])
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        given = getattr(args, f.name)
        if given is not None:
            values[f.name] = [item for part in given for item in part] if _base_type(hints[f.name]) is list else given
        elif env_name(f.name) in env:
            try:
                values[f.name] = _convert(env[env_name(f.name)], hints[f.name])
            except ValueError as exc:
                parser.error(f"{env_name(f.name)}: {exc}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def _add_flag(parser: argparse.ArgumentParser, f: dataclasses.Field, hint: Any) -> None:
    help_text = f.metadata.get("help", "") + f" (env {env_name(f.name)}; default {_default_repr(f)})"
    if _base_type(hint) is bool:
        parser.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                            default=None, help=help_text)
    else:
        base = _base_type(hint)
        choices = list(base) if isinstance(base, type) and issubclass(base, enum.Enum) else None
        parser.add_argument(flag_name(f.name), dest=f.name, default=None, choices=choices,
                            nargs="+" if base is list else None, type=lambda s, h=hint: _convert(s, h),
                            help=help_text)


def _default_repr(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "required"


def _base_type(hint: Any) -> Any:
    """``int | None`` -> int; ``list[str]`` -> list."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType")) and len(args) == 1:
        return _base_type(args[0])
    return typing.get_origin(hint) or hint


def _convert(text: str, hint: Any) -> Any:
    base = _base_type(hint)
    if base is bool:
        lowered = text.strip().lower()
        if lowered not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"expected a boolean, got {text!r}")
        return lowered in ("1", "true", "yes")
    if base is list:
        (item,) = typing.get_args(_strip_optional(hint)) or (str,)
        return [_convert(part, item) for part in text.split(",") if part.strip()]
    if isinstance(base, type) and issubclass(base, enum.Enum):
        try:
            return base(text.strip())
        except ValueError:
            raise ValueError(f"expected one of {', '.join(m.value for m in base)}, got {text!r}") from None
    if base in (int, float, str):
        try:
            return base(text)
        except ValueError:
            raise ValueError(f"expected {base.__name__}, got {text!r}") from None
    raise TypeError(f"unsupported config field type {hint!r}")


def _strip_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is not list and len(args) == 1 else hint


E = TypeVar("E", bound=enum.Enum)


def member(enum_cls: type[E], field_name: str, value: Any) -> E:
    """``value`` as a member of ``enum_cls``, for a config's ``__post_init__`` (callers may pass plain strings);
    a ValueError naming the field and the allowed values otherwise."""
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in enum_cls)
        raise ValueError(f"{field_name} must be one of {allowed}, got {value!r}") from None
