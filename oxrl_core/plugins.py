"""Plugin discovery: the entry-point group ``oxrl`` feeds one pluggy manager.

Every entry point (built-ins included) is loaded on its own, inside its own
try/except: a plugin that fails to import or to register is recorded as a
`LoadError` and the others carry on. Names are resolved lazily: registration
stores an import path, and the target is imported when a run asks for it.

Two packages that register one name (a third-party ``sft``) make that name ambiguous: neither
wins silently by the order of entry points. `oxrl plugins` lists both, and a run that asks for the
name is refused until the user chooses — ``package:name`` (``--alg oxrl-algs-supervised:sft``; an
entry-point name works in place of the package) or the ``OXRL_PLUGINS`` allow-list.

A class a run asks for is checked against its interface (`check_contract`) before any model loads:
a missing ``loss()``, ``loop`` or (in the RL loop) ``advantages()`` is one message naming the
package, not a traceback after the rollouts.

Environment:
  OXRL_PLUGINS          comma-separated allow-list of entry-point or package names
  OXRL_STRICT_PLUGINS=1 any load error is fatal (for CI)
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import traceback
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, get_args

import pluggy

from oxrl_core import hookspecs, interfaces
from oxrl_core.errors import OxrlError, PluginError
from oxrl_core.interfaces import Algorithm, DataFormat, Loop, StrictModel
from oxrl_core.schema import validate_options
from oxrl_core.user_code import import_file

GROUP = "oxrl"
KINDS = {
    "algorithm": "register_algorithms",
    "reward": "register_rewards",
    "dataset": "register_datasets",
    "rollout_backend": "register_rollout_backends",
    "environment": "register_environments",
}


#: names users bring from other frameworks: (kind, name) -> (the oxRL plugin it runs, a one-line note on how
#: they differ). An alias applies only where no installed plugin registers the name itself.
ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    ("algorithm", "grpo"): (
        "sgrpo",
        "'grpo' runs oxRL's sgrpo: GRPO's group z-score advantages and clipped ratio, with clip-higher "
        "(ε_high 0.28 > ε_low 0.2), one token-level mean over the batch instead of GRPO's per-sequence mean, and no "
        "reference KL by default (GRPO's β > 0: set alg.kl_coeff, e.g. 0.04)",
    ),
}


@dataclass
class Registration:
    kind: str
    name: str
    target: Any  # "module:attr" or the object itself
    plugin: str  # entry-point name
    package: str
    version: str

    def origin(self) -> str:
        """Where it comes from, for messages: ``oxrl-mine 0.1 (entry point 'mine', target 'oxrl_mine:Cls')``."""
        target = (
            self.target if isinstance(self.target, str) else getattr(self.target, "__qualname__", repr(self.target))
        )
        version = f" {self.version}" if self.version and self.version not in ("-", "?") else ""
        return f"{self.package}{version} (entry point '{self.plugin}', target '{target}')"

    def load(self) -> Any:
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attr = self.target.partition(":")
        try:
            obj = import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
            for part in filter(None, attr.split(".")):
                obj = getattr(obj, part)
        except Exception as exc:  # any failure in plugin code is reported, not raised raw
            raise PluginError(
                f"{self.kind} '{self.name}' from {self.package} {self.version} failed to load "
                f"{self.target!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return obj


@dataclass
class LoadError:
    plugin: str
    package: str
    version: str
    error: str
    traceback: str = ""
    #: the plugin loaded, but part of what it registered was ignored (a name clash)
    loaded: bool = False


def _norm(package: str) -> str:
    """A distribution name as pip compares them (PEP 503): ``oxrl_algs.Supervised`` == ``oxrl-algs-supervised``."""
    return re.sub(r"[-_.]+", "-", package).lower()


#: where a user names each kind, for the message that asks them to choose
FIELDS = {
    "algorithm": "--alg",
    "reward": "reward.name",
    "dataset": "data.train",
    "rollout_backend": "rollout.backend",
    "environment": "env.name",
}


@dataclass
class Registry:
    entries: dict[str, dict[str, Registration]] = field(default_factory=lambda: {k: {} for k in KINDS})
    errors: list[LoadError] = field(default_factory=list)
    manager: pluggy.PluginManager | None = None
    #: kind -> name -> every registration of a name that more than one package registered (in discovery order)
    clashes: dict[str, dict[str, list[Registration]]] = field(default_factory=lambda: {k: {} for k in KINDS})

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def add(self, reg: Registration) -> None:
        """File a registration; a second package registering a taken name makes the name ambiguous."""
        existing = self.entries[reg.kind].get(reg.name)
        if existing is None:
            self.entries[reg.kind][reg.name] = reg
            return
        if (existing.package, existing.plugin) == (reg.package, reg.plugin):
            raise PluginError(
                f"{reg.kind} '{reg.name}' is registered twice by {reg.package} (entry point '{reg.plugin}')"
            )
        self.clashes[reg.kind].setdefault(reg.name, [existing]).append(reg)

    def prefer(self, reg: Registration) -> None:
        """An explicit choice (the Python API handing over a class): it is the name's only registration."""
        self.clashes[reg.kind].pop(reg.name, None)
        self.entries[reg.kind][reg.name] = reg

    def clash_rows(self) -> list[dict]:
        """One dict per ambiguous name, for `oxrl plugins`: kind, name, the packages and how to pick each."""
        return [
            {
                "kind": kind,
                "name": name,
                "packages": [r.package for r in regs],
                "choose": [f"{r.package}:{name}" for r in regs],
            }
            for kind in KINDS
            for name, regs in sorted(self.clashes[kind].items())
        ]

    def describe_clash(self, kind: str, name: str) -> str:
        """Why ``name`` is ambiguous and the two ways to choose."""
        regs = self.clashes[kind][name]
        who = " and ".join(r.origin() for r in regs)
        picks = " or ".join(f"'{r.package}:{name}'" for r in regs)
        return (
            f"{kind.replace('_', ' ')} '{name}' is registered by {len(regs)} packages: {who}. "
            f"Choose one by naming it with its package ({FIELDS[kind]} {picks}), or load only the one you want "
            f"with the OXRL_PLUGINS allow-list (comma-separated package or entry-point names; it loads only those), "
            f"or uninstall the other"
        )

    def get(self, kind: str, name: str) -> Registration:
        """The registration for `name`, or a PluginError that explains why there is none.

        ``package:name`` (or ``entry-point:name``) picks one package's registration, the way to choose
        between packages that registered the same name. Otherwise a name of the form
        ``path/to/file.py:Class`` or ``package.module:Class`` needs no entry point: it is imported
        directly (for quick experiments, like verl's custom reward path).
        """
        if name in self.clashes[kind]:
            raise PluginError(self.describe_clash(kind, name))
        found = self.entries[kind].get(name)
        if found is not None:
            return found
        if ":" in name:
            chosen = self._by_package(kind, *name.rsplit(":", 1))
            if chosen is not None:
                return chosen
            module_name, _, attr = name.partition(":")
            if module_name.endswith(".py") and not Path(module_name).is_file():
                raise PluginError(f"{kind.replace('_', ' ')} '{name}': file not found: {module_name}")
            if module_name and attr:
                return Registration(kind, name, name, plugin=name, package="(import path)", version="")
        for err in self.errors:
            if err.plugin == name and not err.loaded:
                raise PluginError(
                    f"{kind} '{name}' is provided by {err.package} {err.version}, which failed to load: {err.error}"
                )
        label = kind.replace("_", " ")
        known = self.names(kind)
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        listing = f" Installed: {', '.join(known)}." if known else f" No {label} plugins are installed."
        raise PluginError(f"unknown {label} '{name}'.{hint}{listing} (see `oxrl plugins`)")

    def resolve_alias(self, kind: str, name: str) -> tuple[str, str]:
        """``name``, or the plugin it is an alias of (`ALIASES`) with the note saying how they differ ('' if none)."""
        target = ALIASES.get((kind, name))
        if target is None or self.has(kind, name) or not self.has(kind, target[0]):
            return name, ""
        return target

    def alias_rows(self) -> list[dict]:
        """The aliases that apply here (their plugin installed, the name not taken), for `oxrl plugins`."""
        rows = []
        for (kind, name), (target, note) in ALIASES.items():
            if self.resolve_alias(kind, name)[0] != name:
                rows.append({"kind": kind, "name": name, "alias_of": target, "note": note})
        return rows

    def has(self, kind: str, name: str) -> bool:
        """Whether ``name`` is registered (ambiguous or not), or is a ``package:name`` that picks a registration."""
        return name in self.entries[kind] or (":" in name and self._by_package(kind, *name.rsplit(":", 1)) is not None)

    def _by_package(self, kind: str, package: str, name: str) -> Registration | None:
        """``name`` as registered by ``package`` (a distribution or entry-point name), if it did."""
        regs = self.clashes[kind].get(name) or [r for r in [self.entries[kind].get(name)] if r is not None]
        return next((r for r in regs if _norm(r.package) == _norm(package) or r.plugin == package), None)

    def load(self, kind: str, name: str) -> Any:
        return self.get(kind, name).load()

    def load_checked(self, kind: str, name: str) -> Any:
        """`load`, then `check_contract`: what a run uses, so a broken plugin class fails before any model loads."""
        reg = self.get(kind, name)
        obj = reg.load()
        check_contract(kind, obj, reg)
        return obj

    def check(self, kind: str, name: str, options: Any = None, *, field: str, source: str = "") -> tuple[type, Any]:
        """The class ``name`` names (checked against its interface) and ``options`` validated by its ``Config``;
        an error names the YAML field ``field.option``. Nothing is instantiated: a run checks before any model loads.

        A rollout backend's options are the ``rollout:`` section (its ``options`` key is the backend's, see
        `RolloutBackend.parse_options`)."""
        cls = self.load_checked(kind, name)
        if kind == "rollout_backend":
            return cls, cls.parse_options(options)
        return cls, validate_options(
            cls.Config, options or {}, field=field, source=source or f"{kind.replace('_', ' ')} '{name}'"
        )

    def build(self, kind: str, name: str, options: Any = None, *, field: str, source: str = "", args: tuple = ()):
        """THE way a plugin is built, for every kind: look up ``name`` (``package:name`` picks one of a clash),
        check the class against its interface, validate ``options`` (errors name ``field.option``), instantiate.

        ``Cls(config)``; a rollout backend is ``Cls.build(*args, rollout_section)`` (``args``: the trainer's model,
        tokenizer and model path). A reward or dataset that raises on construction is one message naming it."""
        cls, config = self.check(kind, name, options, field=field, source=source)
        if kind == "rollout_backend":
            return cls.build(*args, options)
        if kind not in _COULD_NOT_START:
            return cls(config)
        try:
            return cls(config)
        except OxrlError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin that cannot start is reported with its name
            where = _COULD_NOT_START[kind].format(field=field, name=name)
            raise OxrlError(f"{where} could not start: {type(exc).__name__}: {exc}") from None

    def rows(self) -> list[dict]:
        """One dict per registration (each of an ambiguous name's, marked ``ambiguous``), for `oxrl plugins`."""
        return [
            {
                "kind": r.kind,
                "name": r.name,
                "package": r.package,
                "version": r.version,
                "plugin": r.plugin,
                "ambiguous": r.name in self.clashes[kind],
            }
            for kind in KINDS
            for first in sorted(self.entries[kind].values(), key=lambda r: r.name)
            for r in self.clashes[kind].get(first.name, [first])
        ]


#: kinds whose construction errors become one message (how it names the plugin); others raise as they are
_COULD_NOT_START = {
    "reward": "reward '{name}'",
    "dataset": "{field}: dataset '{name}'",
    "environment": "{field}: environment '{name}'",
}


def _dist_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"] or "?", dist.version or "?"


def _allowed(ep: EntryPoint, package: str, allow: set[str] | None) -> bool:
    return allow is None or ep.name in allow or package in allow


def discover(extra_plugins: dict[str, Any] | None = None) -> Registry:
    """Load every `oxrl` entry point (plus `extra_plugins`, name -> module/object) into a Registry."""
    pm = pluggy.PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    registry = Registry(manager=pm)
    allow_env = os.environ.get("OXRL_PLUGINS", "").strip()
    allow = {a.strip() for a in allow_env.split(",") if a.strip()} or None

    eps = sorted(entry_points(group=GROUP), key=lambda e: e.name)
    #: (package, target) -> the names of every entry point naming that hook module (allowed or not)
    siblings: dict[tuple[str, str], list[str]] = {}
    for ep in eps:
        siblings.setdefault((_dist_of(ep)[0], ep.value), []).append(ep.name)
    candidates: list[tuple[str, str, str, Any, list[str]]] = []  # (plugin, package, version, loader, siblings)
    seen: set[str] = set()
    for ep in eps:
        package, version = _dist_of(ep)
        key = f"{ep.name}={ep.value}"
        if key in seen or not _allowed(ep, package, allow):
            continue  # the same distribution can appear twice on sys.path (editable + site)
        seen.add(key)
        candidates.append((ep.name, package, version, ep.load, siblings[(package, ep.value)]))
    for name, obj in (extra_plugins or {}).items():
        candidates.append((name, "(in-process)", "-", lambda obj=obj: obj, [name]))

    collected: dict[int, dict[str, list[Registration]]] = {}  # id(hook module) -> entry point -> its names
    for plugin, package, version, loader, names in candidates:
        try:
            obj = loader()
            if not pm.is_registered(obj):  # one hook module behind several entry points: registered once
                pm.register(obj, name=f"{package}:{plugin}")
                try:
                    pm.check_pending()
                except Exception:
                    pm.unregister(name=f"{package}:{plugin}")
                    raise
                collected[id(obj)] = _collect(pm, obj, plugin, names, package, version)
            for reg in collected.get(id(obj), {}).pop(plugin, []):
                try:
                    registry.add(reg)
                except PluginError as exc:  # the same name twice from one plugin: the first one counts
                    registry.errors.append(LoadError(plugin, package, version, str(exc), loaded=True))
        except Exception as exc:  # noqa: BLE001 - isolation: one broken plugin never stops the others
            registry.errors.append(
                LoadError(plugin, package, version, f"{type(exc).__name__}: {exc}", traceback.format_exc())
            )

    if registry.errors and os.environ.get("OXRL_STRICT_PLUGINS", "") not in ("", "0"):
        lines = [f"  {e.plugin} ({e.package} {e.version}): {e.error}" for e in registry.errors]
        raise PluginError("plugins failed to load (OXRL_STRICT_PLUGINS is set):\n" + "\n".join(lines))
    return registry


def _collect(pm, obj, plugin: str, siblings: list[str], package: str, version: str) -> dict[str, list[Registration]]:
    """Call this hook module's registration hooks; file each name under the entry point of the same name
    (one of ``siblings``, the entry points naming this module), else under ``plugin``, the one that loaded it.
    A name whose entry point the OXRL_PLUGINS allow-list leaves out is never filed."""
    pending: dict[str, list[Registration]] = {}
    for kind, hook_name in KINDS.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.plugin is not obj:
                continue

            def register(name: str, target: Any, _kind: str = kind) -> None:
                if not isinstance(name, str) or not name:
                    raise PluginError(f"register() needs a non-empty name, got {name!r}")
                owner = name if name in siblings else plugin
                pending.setdefault(owner, []).append(Registration(_kind, name, target, owner, package, version))

            impl.function(register)
    return pending


_REGISTRY: Registry | None = None


def registry() -> Registry:
    """The process-wide registry (discovered once)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = discover()
    return _REGISTRY


def reset() -> None:
    """Forget the discovered plugins (tests, or after installing a package)."""
    global _REGISTRY
    _REGISTRY = None


# ----------------------------------------------------------------------------- interface contracts


def check_contract(kind: str, obj: Any, reg: Registration) -> None:
    """Refuse a plugin class that breaks its interface (`oxrl_core.interfaces`), naming the package and every
    problem. Checked when a run loads it, before any model: otherwise a missing ``loss()`` is an abstract-class
    TypeError, a missing ``loop`` an AttributeError, and a missing ``advantages()`` surfaces only after the
    models have loaded and the first rollout has run."""
    base = {
        "algorithm": interfaces.Algorithm,
        "reward": interfaces.Reward,
        "dataset": interfaces.Dataset,
        "rollout_backend": interfaces.RolloutBackend,
        "environment": interfaces.Environment,
    }[kind]
    label = kind.replace("_", " ")
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise PluginError(
            f"{label} '{reg.name}' from {reg.origin()}: {obj!r} is not an oxrl_core.{base.__name__} subclass"
        )
    problems = _abstract(obj) + _config_problems(obj) + _CHECKS[kind](obj)
    if problems:
        raise PluginError(
            f"{label} '{reg.name}' from {reg.origin()} breaks the oxrl_core.{base.__name__} interface: "
            + "; ".join(problems)
            + f". Fix the class {obj.__module__}.{obj.__qualname__} (see `help(oxrl_core.{base.__name__})`)"
        )


def _abstract(cls: type) -> list[str]:
    return [f"it does not define {name}()" for name in sorted(getattr(cls, "__abstractmethods__", ()))]


def _config_problems(cls: type) -> list[str]:
    config = getattr(cls, "Config", None)
    if isinstance(config, type) and issubclass(config, StrictModel):
        return []
    return [
        f"Config = {config!r} must be a subclass of oxrl_core.interfaces.StrictModel (so a typo in its options is an error)"
    ]


def _one_of(cls: type, attr: str, allowed: tuple, required: bool = True) -> list[str]:
    """``cls.attr`` must be one of ``allowed`` (a missing attribute: a problem when ``required``)."""
    if not hasattr(cls, attr):
        return [f"it has no `{attr}` (one of {', '.join(map(repr, allowed))})"] if required else []
    value = getattr(cls, attr)
    if isinstance(value, bool) != isinstance(allowed[0], bool) or value not in allowed:
        return [f"{attr} = {value!r} must be one of {', '.join(map(repr, allowed))}"]
    return []


def _algorithm_problems(cls: type) -> list[str]:
    # the deprecated flags a plugin may still declare instead of `loop` (Algorithm.__init_subclass__ derives it)
    problems = _one_of(cls, "family", get_args(Loop), required=False)
    problems += _one_of(cls, "needs_rollouts", (True, False), required=False)
    if not problems:
        problems += _one_of(cls, "loop", get_args(Loop))
    problems += _one_of(cls, "data_format", get_args(DataFormat))
    for flag in ("needs_ref", "needs_teacher", "needs_critic", "loss_on_groups", "self_play"):
        problems += _one_of(cls, flag, (True, False))
    problems += _one_of(cls, "loss_weighting", ("tokens", "sequences")) + _one_of(cls, "head", ("lm", "score"))
    if not (type(cls.min_group_size) is int and cls.min_group_size >= 1):
        problems.append(f"min_group_size = {cls.min_group_size!r} must be an integer >= 1")
    if not isinstance(cls.default_reward, str):
        problems.append(f"default_reward = {cls.default_reward!r} must be a reward name (a string)")
    defaults = getattr(cls, "rollout_defaults", {})
    if not (isinstance(defaults, dict) and all(isinstance(k, str) for k in defaults)):
        problems.append(f"rollout_defaults = {defaults!r} must be a dict of rollout keys (e.g. {{'minibatches': 4}})")
    tiny = getattr(cls, "tiny_defaults", {})
    if not (isinstance(tiny, dict) and all(isinstance(v, dict) for v in tiny.values())):
        problems.append(
            f"tiny_defaults = {tiny!r} must be a dict of config sections (e.g. {{'train': {{'lr': 1e-4}}}})"
        )
    if getattr(cls, "loop", None) == "rl" and cls.advantages is Algorithm.advantages:
        declared = "needs_rollouts = True" if getattr(cls, "needs_rollouts", False) is True else "loop = 'rl'"
        problems.append(f"{declared} but it does not define advantages() (the RL loop calls it on every rollout batch)")
    return problems


def _reward_problems(cls: type) -> list[str]:
    timeout = getattr(cls, "timeout_s", None)
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
    return [] if ok else [f"timeout_s = {timeout!r} must be a number of seconds > 0"]


def _dataset_problems(cls: type) -> list[str]:
    formats = getattr(cls, "formats", None)
    if isinstance(formats, (tuple, list)) and formats and all(f in get_args(DataFormat) for f in formats):
        return []
    return [f"formats = {formats!r} must be a non-empty tuple of {', '.join(map(repr, get_args(DataFormat)))}"]


def _environment_problems(cls: type) -> list[str]:
    timeout = getattr(cls, "timeout_s", None)
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
    problems = [] if ok else [f"timeout_s = {timeout!r} must be a number of seconds > 0"]
    problems += _one_of(cls, "scores_final_answer", (True, False))
    if issubclass(cls, interfaces.ToolEnvironment) and not cls.tool_names():
        problems.append("it is a ToolEnvironment without a tool (a public method)")
    return problems


_CHECKS = {
    "algorithm": _algorithm_problems,
    "reward": _reward_problems,
    "dataset": _dataset_problems,
    "rollout_backend": lambda cls: [],
    "environment": _environment_problems,
}


def deprecation_note(cls) -> str:
    """One line for an algorithm class that declares the old flags instead of ``loop`` (empty otherwise)."""
    flags = getattr(cls, "_deprecated_flags", ())
    if not flags:
        return ""
    loop = getattr(cls, "loop", None)
    use = f"loop = {loop!r}" if loop is not None else "loop"
    return f"algorithm '{getattr(cls, 'name', cls.__name__)}': {' / '.join(flags)} is deprecated; use {use}"
