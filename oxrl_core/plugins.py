"""Plugin discovery: the entry-point group ``oxrl`` feeds one pluggy manager.

Every entry point (built-ins included) is loaded on its own, inside its own
try/except: a plugin that fails to import or to register is recorded as a
`LoadError` and the others carry on. Names are resolved lazily: registration
stores an import path, and the target is imported when a run asks for it.

Environment:
  OXRL_PLUGINS          comma-separated allow-list of entry-point or package names
  OXRL_STRICT_PLUGINS=1 any load error is fatal (for CI)
"""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path
import os
import traceback
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from oxrl_core import hookspecs
from oxrl_core.errors import PluginError

GROUP = "oxrl"
KINDS = {
    "algorithm": "register_algorithms",
    "reward": "register_rewards",
    "dataset": "register_datasets",
    "rollout_backend": "register_rollout_backends",
}


@dataclass
class Registration:
    kind: str
    name: str
    target: Any  # "module:attr" or the object itself
    plugin: str  # entry-point name
    package: str
    version: str

    def load(self) -> Any:
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attr = self.target.partition(":")
        try:
            obj = _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
            for part in filter(None, attr.split(".")):
                obj = getattr(obj, part)
        except Exception as exc:  # noqa: BLE001 - any failure in plugin code is reported, not raised raw
            raise PluginError(
                f"{self.kind} '{self.name}' from {self.package} {self.version} failed to load "
                f"{self.target!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return obj


def _import_file(path: str):
    """Import a Python file as a module (its directory is not added to sys.path)."""
    import importlib.util
    import sys

    module_name = f"oxrl_user_{Path(path).stem}_{abs(hash(str(Path(path).resolve()))) % 10**8}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


@dataclass
class LoadError:
    plugin: str
    package: str
    version: str
    error: str
    traceback: str = ""
    #: the plugin loaded, but part of what it registered was ignored (a name clash)
    loaded: bool = False


@dataclass
class Registry:
    entries: dict[str, dict[str, Registration]] = field(default_factory=lambda: {k: {} for k in KINDS})
    errors: list[LoadError] = field(default_factory=list)
    manager: pluggy.PluginManager | None = None

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def get(self, kind: str, name: str) -> Registration:
        """The registration for `name`, or a PluginError that explains why there is none.

        A name of the form ``path/to/file.py:Class`` or ``package.module:Class`` needs no entry
        point: it is imported directly (for quick experiments, like verl's custom reward path).
        """
        found = self.entries[kind].get(name)
        if found is not None:
            return found
        if ":" in name:
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

    def load(self, kind: str, name: str) -> Any:
        return self.get(kind, name).load()

    def rows(self) -> list[dict]:
        """One dict per registration, for `oxrl plugins`."""
        return [
            {"kind": r.kind, "name": r.name, "package": r.package, "version": r.version, "plugin": r.plugin}
            for kind in KINDS
            for r in sorted(self.entries[kind].values(), key=lambda r: r.name)
        ]


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

    candidates: list[tuple[str, str, str, Any]] = []  # (plugin, package, version, loader)
    seen: set[str] = set()
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        package, version = _dist_of(ep)
        key = f"{ep.name}={ep.value}"
        if key in seen or not _allowed(ep, package, allow):
            continue  # the same distribution can appear twice on sys.path (editable + site)
        seen.add(key)
        candidates.append((ep.name, package, version, ep.load))
    for name, obj in (extra_plugins or {}).items():
        candidates.append((name, "(in-process)", "-", lambda obj=obj: obj))

    for plugin, package, version, loader in candidates:
        try:
            obj = loader()
            if pm.is_registered(obj):
                continue  # one module behind several entry points: its hooks were collected the first time
            pm.register(obj, name=f"{package}:{plugin}")
            try:
                pm.check_pending()
            except Exception:
                pm.unregister(name=f"{package}:{plugin}")
                raise
            _collect(pm, registry, obj, plugin, package, version)
        except Exception as exc:  # noqa: BLE001 - isolation: one broken plugin never stops the others
            registry.errors.append(
                LoadError(plugin, package, version, f"{type(exc).__name__}: {exc}", traceback.format_exc())
            )

    if registry.errors and os.environ.get("OXRL_STRICT_PLUGINS", "") not in ("", "0"):
        lines = [f"  {e.plugin} ({e.package} {e.version}): {e.error}" for e in registry.errors]
        raise PluginError("plugins failed to load (OXRL_STRICT_PLUGINS is set):\n" + "\n".join(lines))
    return registry


def _collect(pm, registry: Registry, obj, plugin: str, package: str, version: str) -> None:
    """Call this plugin's registration hooks and file what it registers."""
    pending: list[Registration] = []
    for kind, hook_name in KINDS.items():
        impls = [impl for impl in getattr(pm.hook, hook_name).get_hookimpls() if impl.plugin is obj]
        for impl in impls:

            def register(name: str, target: Any, _kind: str = kind) -> None:
                if not isinstance(name, str) or not name:
                    raise PluginError(f"register() needs a non-empty name, got {name!r}")
                pending.append(Registration(_kind, name, target, plugin, package, version))

            impl.function(register)
    for reg in pending:
        existing = registry.entries[reg.kind].get(reg.name)
        if existing is not None:
            registry.errors.append(
                LoadError(
                    plugin,
                    package,
                    version,
                    f"{reg.kind} '{reg.name}' is already registered by {existing.package}; ignored",
                    loaded=True,
                )
            )
            continue
        registry.entries[reg.kind][reg.name] = reg


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
