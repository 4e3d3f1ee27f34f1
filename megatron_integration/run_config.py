"""Named training runs (``configs/runs/*.yaml``): launch shape and Megatron-style arguments."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from dynapipe.errors import DynaPipeError
from megatron_integration.args_megatron import shadowed_by


@dataclass(frozen=True)
class RunConfig:
    """A named training run: how to launch it and its Megatron-style arguments."""

    path: str
    argv: tuple[str, ...]
    nnodes: Optional[int] = None
    nproc_per_node: Optional[int] = None
    values: tuple = ()  # the file's (name, value) pairs, as written

    @property
    def world_size(self) -> Optional[int]:
        if self.nnodes is None or self.nproc_per_node is None:
            return None
        return self.nnodes * self.nproc_per_node


def load_run_config(path: str, negatable: frozenset[str] = frozenset()) -> RunConfig:
    """Read a run config: ``launch: {nnodes, nproc_per_node}`` and ``args: {flag: value}``
    (``true`` for a bare flag, a list for several values; names without the ``--``). ``false``
    leaves a flag out, except for the ``negatable`` names (flags on by default, with a ``--no-``
    form), where it gives ``--no-NAME``."""
    from dynapipe.config import CONFIG_DIR, read_yaml

    shipped = os.path.join(CONFIG_DIR, "runs", path if path.endswith(".yaml") else path + ".yaml")
    if os.path.isdir(path) and os.sep not in path and os.path.exists(shipped):
        path = shipped  # a folder is no run config: the shipped run of that name is meant
    if not os.path.exists(path):
        if not os.path.exists(shipped):
            raise DynaPipeError(f"--run-config {path!r}: no such file (nor a shipped run in configs/runs/).")
        path = shipped
    if os.path.isdir(path):
        raise DynaPipeError(f"--run-config {path!r} is a directory; give a run config YAML file (such as "
                            f"configs/runs/gpt-7b-pp4-dp2-h100.yaml) or a shipped run name.")
    data = {} if os.path.isfile(path) and os.path.getsize(path) == 0 else read_yaml(path)
    data = data or {}
    unknown = sorted(set(data) - {"launch", "args", "description"}) if isinstance(data, dict) else ["not a mapping"]
    if unknown or not isinstance(data.get("args", {}), dict):
        raise DynaPipeError(f"{path}: a run config holds 'description', 'launch' and an 'args' mapping; "
                            f"unexpected: {unknown or type(data.get('args')).__name__}.")
    if not data.get("args"):
        # Else the run would stop on the first required flag it lacks, naming no file.
        raise DynaPipeError(f"{path}: the run config gives no arguments; it holds an 'args' mapping of flags "
                            f"(names without the --) to values.")
    argv: list[str] = []
    for key, value in data.get("args", {}).items():
        flag = "--" + str(key)
        if value is True:
            argv.append(flag)
        elif value is False and key in negatable:
            argv.append("--no-" + str(key))
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag] + [str(v) for v in value]
        else:
            argv += [flag, str(value)]
    launch = data.get("launch", {}) or {}
    if not isinstance(launch, dict) or set(launch) - {"nnodes", "nproc_per_node"}:
        raise DynaPipeError(f"{path}: 'launch' holds nnodes and nproc_per_node only; got {launch!r}.")
    for key, value in launch.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DynaPipeError(f"{path}: launch.{key}={value!r} must be a positive integer.")
    return RunConfig(path, tuple(argv), launch.get("nnodes"), launch.get("nproc_per_node"),
                     tuple(data.get("args", {}).items()))


def check_run_values(run: RunConfig, parser) -> None:
    """Refuse a run config entry the parser would misread, naming the file and the entry: a name
    that is no flag of the script, a value for a bare flag (``mock-data: "yes"``), a list for a
    flag of one value. (The argv alone would only say "unrecognized arguments: yes".)"""
    from megatron_integration.args_refusals import unsupported_reason

    actions = {opt[2:]: a for a in parser._actions for opt in a.option_strings if opt.startswith("--")}
    for key, value in run.values:
        action = actions.get(str(key))
        if action is None and value is False and f"no-{key}" in actions:
            continue  # given as --no-KEY
        if action is None and unsupported_reason(f"--{key}") is not None:
            continue  # the parser names it with the reason this build does not take it
        if action is None:
            raise DynaPipeError(f"{run.path}: args.{key} is not a flag of this script; check its spelling "
                                f"(names without the leading --).")
        if action.nargs == 0 and not isinstance(value, bool) and value is not None:
            raise DynaPipeError(f"{run.path}: args.{key} is an on/off flag; give true or false, not {value!r}.")
        if isinstance(value, list) and action.nargs in (None, "?"):
            raise DynaPipeError(f"{run.path}: args.{key} takes one value, not the list {value!r}.")
        bare_ok = action.nargs in ("?", "*")  # such a flag may stand alone
        if action.nargs != 0 and (value is False or (value is True and not bare_ok)):
            # true would pass the flag without its value, false drop it unsaid (null stays the
            # script's default: templated configs write it).
            raise DynaPipeError(f"{run.path}: args.{key} takes a value, not {str(value).lower()}; give one, or "
                                f"null (or no entry) for the script's default.")


def add_run_config_argument(parser) -> None:
    """``--run-config FILE``: a run config giving the arguments (the command line's win)."""
    parser.add_argument("--run-config", default=None,
                        help="YAML run config (configs/runs/, or one `python -m dynapipe advise --output` wrote) "
                             "giving the arguments; those given on the command line win, and one of Megatron-LM's "
                             "alternatives typed there (--train-samples, --data-path, ...) replaces the file's "
                             "choice (--train-iters, --mock-data, ...); a switch the file turns on stays on")


def negatable_flags(parser) -> frozenset[str]:
    """Names ``X`` (without ``--``) for which the parser has a ``--no-X`` flag, such as Megatron-LM's
    ``--check-for-nan-in-loss-and-grad`` or ``--ckpt-fully-parallel-save``: a run config's
    ``X: false`` must turn them off, not leave them at their default (on)."""
    return frozenset(opt[5:] for action in parser._actions for opt in action.option_strings
                     if opt.startswith("--no-"))


def with_run_config(parser, argv: list[str], world_size: int) -> list[str]:
    """``argv`` with the arguments of its ``--run-config`` (if any) in front, so those given
    on the command line win; refuses a run config written for another number of ranks."""
    path = parser.parse_known_args(argv)[0].run_config
    if path == "":  # an unset shell variable, say: not the same as no --run-config
        raise DynaPipeError("--run-config '': an empty path; give a run config file or a shipped run name, or leave "
                            "the flag out.")
    if not path:
        return argv
    run = load_run_config(path, negatable_flags(parser))
    check_run_values(run, parser)
    if run.world_size is not None and run.world_size != world_size:
        raise DynaPipeError(f"{run.path} is a run of {run.nnodes} node(s) x {run.nproc_per_node} processes "
                            f"= {run.world_size} ranks, but this job has {world_size}; launch it with "
                            f"torchrun --nnodes {run.nnodes} --nproc-per-node {run.nproc_per_node}.")
    typed = {a.split("=")[0] for a in argv if a.startswith("--")}
    kept = _without(list(run.argv), shadowed_by(typed))
    _check_schedule_units(typed, kept, run.path)
    return kept + list(argv)


# A run's length typed in one unit, and the file's schedule lengths in the other, which Megatron-LM
# refuses beside it (its validate_args: iterations with --train-iters, samples with --train-samples).
# Each of the file's lengths in the other unit, with what replaces it.
_UNITS = {"--train-samples": ("samples", {"--lr-warmup-iters": "--lr-warmup-samples or --lr-warmup-fraction",
                                          "--lr-decay-iters": "--lr-decay-samples"}),
          "--train-iters": ("iterations", {"--lr-warmup-samples": "--lr-warmup-iters or --lr-warmup-fraction",
                                           "--lr-decay-samples": "--lr-decay-iters"})}


def _check_schedule_units(typed: set, kept: list[str], path: str) -> None:
    """Refuse a run length typed in ``typed`` whose unit the file's kept schedule lengths
    (``kept``: the file's arguments the command line leaves) do not share, naming the file: the
    user typed only the length, and Megatron-LM's refusal of the file's flags would name flags
    they never typed."""
    for flag, (unit, other) in _UNITS.items():
        clash = [f for f in other if flag in typed and f in kept]
        if clash:
            at = kept.index(clash[0]) + 1
            value = kept[at] if at < len(kept) else ""
            raise DynaPipeError(f"{flag} counts the run in {unit}, but {path} gives {clash[0][2:]}: {value}, which "
                                f"Megatron-LM refuses beside it; give it in {unit} on the command line "
                                f"({other[clash[0]]}), which replaces the file's.")


def _without(argv: list[str], flags: set) -> list[str]:
    """``argv`` without each of ``flags`` and its values (every item up to the next flag)."""
    out, skipping = [], False
    for a in argv:
        if a.startswith("--"):
            skipping = a.split("=", 1)[0] in flags
        if not skipping:
            out.append(a)
    return out
