"""Validated configuration, the base of every config section: `StrictModel`, and the one place a
pydantic ``ValidationError`` becomes an `OxrlError` that names the YAML field.

A leaf module: it imports pydantic and `oxrl_core.errors`, nothing else of oxRL (see the layer
table in ``docs/architecture.md``). `StrictModel` is re-exported by `oxrl_core.interfaces`, where
plugins import it from.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from oxrl_core.errors import OxrlError


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, and so is a float that is NaN or infinite
    (``train.lr=.inf``): a non-finite hyper-parameter only shows up later as NaN weights. Plugin configs
    subclass this, so their floats are checked the same way."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_in_64_bits(cls, value: Any) -> Any:
        """An integer field (any section, any plugin) must fit in 64 bits: torch, numpy and the OS take no
        more, and a larger one (``train.max_steps=1e30`` as an int) would fail deep inside them."""
        if type(value) is int and not -(2**63) <= value < 2**63:
            raise ValueError("must fit in a signed 64-bit integer (|value| < 2^63)")
        return value


def _fields_of(model_cls, loc: tuple) -> list[str]:
    """Field names valid at `loc` (for 'did you mean')."""
    cls = model_cls
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None or not hasattr(field.annotation, "model_fields"):
            return []
        cls = field.annotation
    return list(getattr(cls, "model_fields", {}))


def format_validation_error(exc: ValidationError, model_cls, source: str, prefix: str = "") -> OxrlError:
    """One line per problem, each naming the dotted field (``prefix`` + pydantic's location):
    an unknown key gets "did you mean" and the valid fields, any other error pydantic's message and
    the value it got. ``source`` (the file, or what the options came from) heads the message."""
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        dotted = prefix + ".".join(loc)
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc[-1], _fields_of(model_cls, loc), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            valid = ", ".join(_fields_of(model_cls, loc))
            lines.append(f"  {dotted}: unknown field{hint}; valid fields: {valid}")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            head = f"{dotted}: " if dotted else ""  # a rule across sections names its fields in its message
            lines.append(f"  {head}{err['msg'].removeprefix('Value error, ')}{shown}")
    return OxrlError(f"invalid config ({source}):\n" + "\n".join(lines))


def validate_options(config_cls, options: Any, *, field: str, source: str) -> Any:
    """A plugin's options validated by its ``Config``, the one validation of every plugin kind: an error
    names each YAML field as ``field.option`` (``alg.beta``, ``reward.timeout_s``, ``rollout.x``,
    ``data.train[0].split``) under ``invalid config (source)``."""
    try:
        return config_cls.model_validate(options)
    except ValidationError as exc:
        raise format_validation_error(exc, config_cls, source, prefix=f"{field}.") from None
