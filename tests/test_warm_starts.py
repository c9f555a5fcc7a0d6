"""The stored warm starts (`warm_starts.py`) are the ones the product would build now, and the session uses them."""

from __future__ import annotations

import json

import warm_starts
from safetensors import safe_open


def test_every_warm_start_the_built_in_tasks_need_is_stored_under_the_name_the_product_gives_it(oxrl_cache):
    """A change to the tiny models, their tokenizers or the warm-start recipe renames the warm start (or changes
    its files): the stored one would then silently stop being used, and the suite would train its own, which
    differs from machine to machine. Re-record with ``python tests/warm_starts.py``."""
    for path in warm_starts.wanted():
        stored = warm_starts.STORED / path.name
        assert (stored / "config.json").is_file(), f"no stored warm start {path.name}: python tests/warm_starts.py"
        base = path.parent / path.name.rsplit("-", 2)[0]  # the untrained model it was trained from
        # the same model, vocabulary and chat template as the untrained directory
        assert _config(stored) == _config(base), path.name
        assert _vocabulary(stored) == _vocabulary(base), f"{path.name}: the tokenizer differs"
        template = "chat_template.jinja"
        assert (stored / template).read_text() == (base / template).read_text(), f"{path.name}: the template differs"
        # the same tensors, trained: every name and shape as in the untrained model, and the weights moved
        with (
            safe_open(base / warm_starts.WEIGHTS, "pt") as untrained,
            safe_open(stored / warm_starts.WEIGHTS, "pt") as got,
        ):
            assert sorted(untrained.keys()) == sorted(got.keys()), path.name
            moved = 0
            for key in untrained.keys():
                before, after = untrained.get_tensor(key), got.get_tensor(key)
                assert before.shape == after.shape and after.dtype == before.dtype, key
                moved += bool((before != after).any())
            assert moved >= len(list(untrained.keys())) // 2, f"{path.name}: only {moved} tensors trained"
        # and the session's cache serves the stored one (conftest copied it in before any test ran)
        assert (path / warm_starts.WEIGHTS).read_bytes() == (stored / warm_starts.WEIGHTS).read_bytes(), path.name
        assert _config(path) == _config(stored), path.name


def _config(directory) -> dict:
    """A saved model's config.json without the ``dtype`` entries (a reloaded VLM writes them into its sub-configs
    too; every weight here is float32, checked above) and the version of transformers that wrote it (a patch
    release of transformers writes another number for the same model)."""

    def strip(tree):
        skip = ("dtype", "transformers_version")
        return {k: strip(v) for k, v in tree.items() if k not in skip} if isinstance(tree, dict) else tree

    return strip(json.loads((directory / "config.json").read_text()))


def _vocabulary(directory) -> tuple:
    """What a tokenizer maps text to: its model's vocabulary and merges and its added tokens (tokenizer.json as a
    file also records the writer's format, which another release of `tokenizers` may write otherwise)."""
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    added = sorted((t["id"], t["content"], t["special"]) for t in tokenizer["added_tokens"])
    model = tokenizer["model"]
    return model["type"], model["vocab"], [list(m) if isinstance(m, list) else m for m in model["merges"]], added


def test_a_worker_that_loses_the_race_to_publish_keeps_the_winners_directory(tmp_path, monkeypatch):
    """Two xdist workers seed the same cache at once: both find the entry missing, both copy, one renames first.
    The other's rename onto the now non-empty directory fails (ENOTEMPTY); that is a lost race, not an error:
    the winner's files are kept and the loser's copy is removed. (CI once failed every test of a worker here: the
    other worker published between this one's check and its rename.)"""
    import os

    from oxrl_core.models import tiny

    target = tmp_path / "entry"
    rename = os.replace

    def publish_first_then_rename(src, dst):  # the other worker wins just before this rename
        target.mkdir()
        (target / "theirs").write_text("winner")
        rename(src, dst)

    monkeypatch.setattr(tiny.os, "replace", publish_first_then_rename)
    assert tiny.publish_dir(target, lambda tmp: (tmp.mkdir(), (tmp / "mine").write_text("loser"))) == target
    assert sorted(p.name for p in target.iterdir()) == ["theirs"]
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no temporary copy is left behind


def test_a_publish_that_fails_for_another_reason_still_raises(tmp_path):
    """Only a lost race is swallowed: a rename that fails with nothing published (here: the writer wrote nothing,
    as after a full disk it might) raises."""
    import pytest

    from oxrl_core.models.tiny import publish_dir

    with pytest.raises(FileNotFoundError):
        publish_dir(tmp_path / "entry", lambda tmp: None)
    assert not (tmp_path / "entry").exists()
