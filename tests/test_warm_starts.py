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
