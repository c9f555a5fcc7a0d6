"""The warm starts the suite runs from, stored in ``fixtures/warm_starts/`` instead of trained at test time.

The RL and preference runs on the built-in tasks begin from a warm start: the tiny model after a few hundred
steps of SFT (`oxrl_core.models.tiny.warm_start_dir`, `tiny_vlm.vlm_warm_start_dir`). That SFT is deterministic
on one machine, but not across machines: a CPU with other vector units (AVX-512 or AVX2), or another thread count,
rounds the first step's matmuls differently (1e-8 relative), and 450 steps of AdamW at lr 1e-3 grow that to
weights 0.14 apart. Measured here by building the 450-step warm start twice on one host, once with
``ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE``: the losses agree to 1e-8 at step 0, to 1e-4 by step 50, and
differ in the second digit by step 100, also with the SFT in float64 (LlamaRMSNorm computes in float32 whatever
the weights are). A golden run or a demo threshold measured from a warm start built at test time therefore holds
on the machine that measured it only.

So the session's cache (`conftest.oxrl_cache`) is seeded with these stored directories, each under the name the
product gives it (the name hashes the tokenizer's whole definition, so a stored warm start is never served for
another tokenizer). The code that builds warm starts is still exercised: `test_progress.py` builds short ones,
and the test below checks that every stored one is the one the product would build now, by name and by files.

Re-record (after a change to the warm-start recipe, the tiny models or their tokenizer; say why in the commit):
``python tests/warm_starts.py``. It builds each warm start in a fresh cache, with 2 threads, and replaces the
stored ones; the golden runs (``python tests/test_golden.py``) are then re-recorded from them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

STORED = Path(__file__).parent / "fixtures" / "warm_starts"
#: the weights' file in each stored directory (beside it: config, tokenizer or processor files, as the model saves them)
WEIGHTS = "model.safetensors"


def wanted() -> list[Path]:
    """The cache paths of the three warm starts the built-in tasks begin from, in the current ``$OXRL_CACHE``
    (the untrained tiny models are built there when missing: they are seeded and the same on every machine)."""
    from oxrl_core.models.tiny import warm_start_path  # lazy: torch only once the cache is set
    from oxrl_core.models.tiny_vlm import vlm_warm_start_path  # lazy: as above

    return [warm_start_path(), warm_start_path(tools=True), vlm_warm_start_path()]


def install(cache: Path) -> list[Path]:
    """Copy every stored warm start into ``cache`` (those already there are kept); the paths copied."""
    from oxrl_core.models.tiny import publish_dir  # lazy: as above

    copied = []
    for stored in sorted(STORED.iterdir()) if STORED.is_dir() else []:
        target = cache / stored.name
        if not (target / "config.json").exists():
            publish_dir(target, lambda tmp, stored=stored: shutil.copytree(stored, tmp))  # workers may race: kept
            copied.append(target)
    return copied


def record() -> None:
    """Build the three warm starts in a fresh cache, with 2 threads, and store them (replacing the stored ones)."""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["OXRL_CACHE"] = cache
        import torch  # lazy: after the cache is set

        torch.set_num_threads(2)
        from oxrl_core.models.tiny import warm_start_dir  # lazy: as above
        from oxrl_core.models.tiny_vlm import vlm_warm_start_dir  # lazy: as above

        built = [warm_start_dir(), warm_start_dir(tools=True), vlm_warm_start_dir()]
        shutil.rmtree(STORED, ignore_errors=True)
        STORED.mkdir(parents=True)
        for path in built:
            shutil.copytree(path, STORED / path.name)
            print(f"stored {STORED / path.name}")


if __name__ == "__main__":
    record()
