"""The config vocabulary's history: keys that were renamed, and how an old name is read.

A YAML file, a --set, the Python API's sections and an older run's config.yaml (--resume, oxrl report) may
still use an old name; it is read as the new one with a one-line note naming the new key, and both names at
once is an error naming both. Kept apart from `oxrl_core.config` so that the section models which read old
names themselves (`oxrl_core.config_rollout`) need nothing above them.
"""

from __future__ import annotations

from typing import Any

#: Keys renamed in the config vocabulary: old dotted name -> new. Read from a YAML file, a --set, the Python API's
#: sections and an older run's config.yaml (--resume, oxrl report), each with a one-line note naming the new key
#: (`oxrl_core.config.rename_keys`, `oxrl_core.config.apply_overrides`); both names given at once is an error naming
#: both. config.yaml is written with the new names. ``rollout.options.<key>`` (the rollout backend's options, once
#: nested) is read as ``rollout.<key>``.
RENAMED_KEYS = {
    "train.save_steps": "train.save_every",
    "train.eval_steps": "train.eval_every",
    "train.log_steps": "train.log_every",
    "train.save_limit": "train.save_total_limit",
    "rollout.epochs": "rollout.passes_per_batch",
}
#: the old mapping of the rollout backend's own options, now written flat beside rollout.backend
OLD_ROLLOUT_OPTIONS = "rollout.options"


def deprecation_note(old: str, new: str) -> str:
    """The one-line note an old key gets (printed once per key per run, prefixed ``note:``)."""
    if old == OLD_ROLLOUT_OPTIONS:
        return f"{old} is deprecated; write the rollout backend's options flat under rollout: ({new})"
    return f"{old} is deprecated; use {new}"


def both_given(old: str, new: str) -> str:
    """The error of an old and a new name of one key given together."""
    return f"{old} and {new} are both set; {old} is the old name of {new}: keep only {new}"


def core_option(key: str) -> str:
    """The error of an option under the old rollout.options whose flat name is one of oxRL's own rollout keys."""
    return (
        f"{OLD_ROLLOUT_OPTIONS}.{key}: the rollout backend's options now sit flat under rollout:, where {key} is "
        f"oxRL's own rollout.{key}; a backend option cannot share its name"
    )


def renamed_section(data: Any, section: str) -> Any:
    """One section's mapping with the old key names of `RENAMED_KEYS` replaced by the new ones (no note: the
    models' own validators, for a section built in Python; a YAML file goes through `rename_keys` first). The
    old ``rollout.options`` mapping is flattened by `oxrl_core.config_rollout.rollout_renamed`."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for old, new in RENAMED_KEYS.items():
        (sec, old_key), new_key = old.split("."), new.split(".")[1]
        if sec == section and old_key in data:
            if new_key in data:
                raise ValueError(both_given(old, new))
            data[new_key] = data.pop(old_key)
    return data


def renamed_key(key: str) -> tuple[str, str | None]:
    """A --set key in the new vocabulary, and the old name it was given by (None when it is not an old one)."""
    if key in RENAMED_KEYS:
        return RENAMED_KEYS[key], key
    if key.startswith(f"{OLD_ROLLOUT_OPTIONS}."):
        return "rollout." + key.removeprefix(f"{OLD_ROLLOUT_OPTIONS}."), OLD_ROLLOUT_OPTIONS
    return key, None
