"""Reading YAML configs and building their dataclasses, with one-line errors.

:func:`read_yaml` is shared by the model, device and cluster configs (:mod:`dynapipe.config`),
the run configs and the data mixtures; :func:`build_dataclass` builds the configs. A missing or
malformed file, a duplicated key, an unknown key, a value of the wrong type (with why YAML read a
number as text) or a missing one is refused naming the file and the field.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import yaml

from dynapipe.errors import DynaPipeError, field_problem


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (the plain loader keeps
    the last silently: a config that says ``num_layers`` twice would build the second)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base loader names it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str) -> dict:
    """The mapping a YAML config file holds; one clear line for a missing, unreadable or
    malformed file, a key given twice, or anything but a mapping."""
    if not os.path.exists(path):
        raise DynaPipeError(f"config file {path!r} does not exist.")
    if os.path.isdir(path):
        raise DynaPipeError(f"config file {path!r} is a directory; give a YAML file.")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        first = " ".join(str(e).split())
        raise DynaPipeError(f"config file {path!r} is not valid YAML: {first}") from None
    except UnicodeDecodeError:
        raise DynaPipeError(f"config file {path!r} is not UTF-8 text (a binary file?); give a YAML file.") from None
    except OSError as e:
        raise DynaPipeError(f"config file {path!r} cannot be read: {e.strerror}.") from None
    except RecursionError:
        raise DynaPipeError(f"config file {path!r} is nested too deeply to be a config.") from None
    if not isinstance(data, dict):
        raise DynaPipeError(f"config file {path!r} must hold a mapping of keys to values.")
    return data


def _yaml_number_hint(value, field_type: str) -> str:
    """Why a number came back as text: YAML 1.1 reads ``1e-9``, ``1e6`` and ``2.5e1`` as strings
    (its floats need a dot and a signed exponent), so say how to write it."""
    if field_type not in ("int", "float") or not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):  # 'inf' and 'nan' are text to YAML too, and refused anyway
        return ""
    if field_type == "int" and number.is_integer():
        return f" (YAML reads {value} as text; write {int(number)})"
    mantissa, _, exponent = value.strip().lower().partition("e")
    if not exponent:
        return f" (YAML reads {value} as text; write {number!r})"
    mantissa = mantissa if "." in mantissa else mantissa + ".0"
    exponent = exponent if exponent[0] in "+-" else "+" + exponent
    return (f" (YAML reads {value} as text: a number with an exponent needs a dot and a signed exponent, "
            f"as in {mantissa}e{exponent})")


def build_dataclass(cls, data: Mapping[str, Any], source: str):
    """``cls(**data)`` after checking every key is one of its fields, every scalar field has
    its annotated type (finite numbers), and no required field is missing; errors name
    ``source`` and the field."""
    if not isinstance(data, Mapping):
        raise DynaPipeError(f"{source}: expected a mapping of keys to values, got {type(data).__name__}.")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DynaPipeError(f"{source}: unknown key(s) {unknown}; known keys are {sorted(names)}.")
    for f in dataclasses.fields(cls):
        problem = field_problem(f.name, data[f.name], f.type) if f.name in data else None
        if problem is not None:
            raise DynaPipeError(f"{source}: {problem}{_yaml_number_hint(data[f.name], f.type)}.")
    required = [f.name for f in dataclasses.fields(cls) if f.name not in data
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        raise DynaPipeError(f"{source}: {', '.join(required)} missing; see the shipped configs under configs/ for "
                            f"the keys each kind needs.")
    try:
        return cls(**data)
    except TypeError as e:
        raise DynaPipeError(f"{source}: {e}") from None
