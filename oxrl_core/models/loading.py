"""Loading models and tokenizers (hub id or local dir; empty name = the built-in tiny model)."""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path

from oxrl_core.chat_templates import chat_template_text, names, render_problem, template_source
from oxrl_core.data.images import is_image_row
from oxrl_core.data.sources import path_kind
from oxrl_core.errors import OxrlError
from oxrl_core.hf_env import quiet_transformers
from oxrl_core.models.linear_attention import per_sequence_linear_attention
from oxrl_core.models.tiny import default_model_dir, warm_start_dir
from oxrl_core.models.tiny_vlm import default_vlm_dir, vlm_warm_start_dir
from oxrl_core.models.token_head import choose_path
from oxrl_core.models.vision import is_vlm_config, placeholder_token_ids, vision_family
from oxrl_core.observability.progress import activity

#: the run's ``model.*`` loading options (revision, dtype, chat_template), set around a run's loop by
#: `model_options`; outside a run (``oxrl eval``, tests) every model loads as saved, in float32
_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("oxrl_model_options", default=None)


@contextlib.contextmanager
def model_options(model_cfg):
    """Within this block the loaders honour ``model_cfg`` (a `config.ModelConfig`): ``revision`` for
    ``model.name`` when it is fetched from the hub (a local directory or checkpoint has none), ``dtype`` for
    every causal LM and score model, ``chat_template`` for every tokenizer."""
    token = _OPTIONS.set(model_cfg)
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def _revision(path: str) -> str | None:
    """``model.revision`` when ``path`` is ``model.name`` itself (the reference and tokenizer of a run load it too)."""
    options = _OPTIONS.get()
    if options is None or not options.revision or path != options.name:
        return None
    return options.revision


def _dtype():
    """The dtype models load in (``model.dtype``): float32 unless the run says otherwise; ``"auto"`` as is."""
    import torch

    options = _OPTIONS.get()
    name = options.dtype if options is not None else "float32"
    return "auto" if name == "auto" else getattr(torch, name)


def _apply_chat_template(tokenizer, path: str, field: str) -> None:
    """Set ``model.chat_template`` on the tokenizer, then check the template it ends up with renders a user
    turn and a user/assistant conversation: a template that does not compile or raises on them is an
    error naming the template, its line and jinja2's message, before any row is tokenised (a model's own
    template too: ``model.chat_template`` is the way round it)."""
    options = _OPTIONS.get()
    chosen = options.chat_template if options is not None else ""
    if chosen:
        tokenizer.chat_template = chat_template_text(chosen)
    problem = render_problem(tokenizer)
    if problem is None:
        return
    if chosen:
        source = f"'{chosen}' (built-in)" if chosen in names() else str(Path(chosen).expanduser())
        raise OxrlError(f"model.chat_template: the chat template {source} {problem}; fix the template")
    raise OxrlError(
        f"{field}: the tokenizer's chat template ({template_source(path)}) {problem}; fix it there, or set "
        f"model.chat_template to a Jinja file or a built-in ({', '.join(names())})"
    )


#: what a model field takes, for the message when a value cannot even be looked up as a path
MODEL_EXPECTED = "a model directory or a hub id"


def resolve_model_path(name: str) -> str:
    if not name:
        return str(default_model_dir())
    return name


def initial_policy_path(name: str, log=None, tools: bool = False, reporter=None, images: bool = False) -> str:
    """Where RL and preference runs start: ``model.name``, or with it empty the built-in tiny model
    after its cached SFT warm start on the built-in task (a random model never answers right); with
    ``tools`` (multi-turn RL), the warm start on tool-use transcripts; with ``images`` (the data has image rows),
    the built-in tiny VLM after its warm start on the ``shapes`` task. ``reporter`` shows its progress."""
    if name:
        return name
    if images:
        return str(vlm_warm_start_dir(log=log, reporter=reporter))
    return str(warm_start_dir(log=log, tools=tools, reporter=reporter))


def builtin_model_for(name: str, rows: list[dict]) -> str:
    """``model.name``, or with it empty the built-in model for these rows: the tiny VLM (`tiny_vlm`) when a row has
    images, else "" (the built-in tiny text model, `resolve_model_path`)."""
    if name or not any(is_image_row(r) for r in rows):
        return name
    return str(default_vlm_dir())


def _check_local_dir(path: str, field: str) -> None:
    """A name that is clearly a path (not a hub id) must exist; say so instead of a hub error.
    A name the OS cannot even look up (longer than its file-name limit, ...) is an error naming ``field``."""
    if path_kind(path, field, MODEL_EXPECTED) is None and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise OxrlError(f"{field}: model directory not found: {path}")


#: files that hold a tokenizer (any one is enough for `AutoTokenizer`)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tokenizer_config.json",
)


def _listing(root: Path) -> str:
    names = sorted(p.name for p in root.iterdir())
    return "it is empty" if not names else f"it holds {', '.join(names[:6])}{', ...' if len(names) > 6 else ''}"


def weight_files(root: Path, field: str) -> list[Path]:
    """The weight files a model directory's loader will read: the shards an index lists (each must be
    there), else ``*.safetensors``, else ``pytorch_model*.bin``; none is an error saying so."""
    import json

    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = root / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
                raise OxrlError(
                    f"{field}: {index} is corrupt ({type(exc).__name__}: {exc}); re-save or re-download the model"
                ) from None
            missing = [name for name in shards if not (root / name).is_file()]
            if missing:
                raise OxrlError(
                    f"{field}: {index_name} in {root} lists {len(missing)} weight file(s) that are not there "
                    f"({', '.join(missing[:3])}); the download or copy is incomplete"
                )
            return [root / name for name in shards]
    found = sorted(root.glob("*.safetensors")) or sorted(root.glob("pytorch_model*.bin"))
    if not found:
        raise OxrlError(
            f"{field}: no weights in {root} (no model.safetensors, sharded *.safetensors with their index, "
            f"or pytorch_model.bin; {_listing(root)}); point {field} at a complete model directory"
        )
    return found


def _check_safetensors(path: Path, field: str) -> None:
    """Read a .safetensors file's header: a truncated or garbled file fails here with the real cause
    (cheap: the header only, the tensors are memory-mapped, not read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: the file cannot be what it says
        size = path.stat().st_size if path.exists() else 0
        raise OxrlError(
            f"{field}: {path.name} in {path.parent} is corrupt or truncated ({size} bytes): "
            f"{' '.join(str(exc).split())}; re-save or re-download the model"
        ) from None


def check_model_dir(root: Path, field: str) -> None:
    """A local model directory holds what loading needs: config.json and complete, readable weights.

    Catches the cases transformers reports as something else: an empty directory (its tokenizer
    error asks to install sentencepiece or tiktoken), a truncated ``model.safetensors`` (an error
    deep in the loader), a shard the index lists but the copy lacks. A PEFT adapter directory
    (``adapter_config.json``, no config.json) is left to transformers."""
    if (root / "adapter_config.json").is_file() and not (root / "config.json").exists():
        return
    if not (root / "config.json").is_file():
        raise OxrlError(
            f"{field}: no config.json in {root}, so it is not a Hugging Face model directory ({_listing(root)}); "
            f"point {field} at the directory that holds config.json and the weights (e.g. a run's final/)"
        )
    for path in weight_files(root, field):
        if path.suffix == ".safetensors":
            _check_safetensors(path, field)


def check_model_path(name: str, field: str = "model.name") -> None:
    """What can be checked of a model before it loads: a path that exists, and for a local directory
    its config and complete, readable weights (`check_model_dir`). A hub id passes (the hub decides).
    Cheap (safetensors headers only), so `Trainer` runs it before the run directory exists."""
    if not name:
        return
    _check_local_dir(name, field)
    kind = path_kind(name, field, MODEL_EXPECTED)
    if kind == "file":
        raise OxrlError(f"{field}: '{name}' is a file; give the model directory (the one holding config.json)")
    if kind == "dir":
        check_model_dir(Path(name).expanduser(), field)


def load_tokenizer(name: str, field: str = "model.name", trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    quiet_transformers()
    path = resolve_model_path(name)
    check_model_path(path, field)
    local = Path(path).expanduser()
    if (
        local.is_dir()
        and not any((local / f).is_file() for f in TOKENIZER_FILES)
        and not list(local.glob("*.tiktoken"))
    ):
        raise OxrlError(
            f"{field}: no tokenizer files in {local} (none of {', '.join(TOKENIZER_FILES)}); "
            "copy the base model's tokenizer files into it (tokenizer.save_pretrained)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=_revision(path))
    except Exception as exc:  # noqa: BLE001 - missing dir, offline hub, bad files: one message
        raise OxrlError(f"{field}: cannot load a tokenizer from '{path}': {type(exc).__name__}: {exc}") from None
    _apply_chat_template(tokenizer, path, field)
    if tokenizer.eos_token_id is None:
        raise OxrlError(f"{field}: the tokenizer at '{path}' has no EOS token; completions end with EOS")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _untied(model, keys) -> set[str]:
    """``keys`` less those whose parameter is tied to one that loaded (e.g. an LM head sharing the
    input embedding under ``tie_word_embeddings``: absent from the checkpoint on purpose, not random)."""
    keys = set(keys)
    names_by_storage: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_storage.setdefault(param.data_ptr(), set()).add(name)
    tied = {k for names in names_by_storage.values() if names - keys for k in names & keys}
    return keys - tied


def _examples(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:4]) + (f", ... ({len(keys)} in all)" if len(keys) > 4 else "")


def check_loading(
    model, info: dict, path: str, field: str, new_ok: tuple[str, ...] = (), unused_ok: tuple[str, ...] = ()
) -> tuple[list, list]:
    """Refuse weights that do not match the class they load into (transformers would initialise the
    missing ones at random and drop the unexpected ones, with a warning oxRL silences).

    ``new_ok`` / ``unused_ok``: key prefixes that may be missing (a fresh head the run trains, e.g. a
    reward model's ``score``) or unused (a causal LM's ``lm_head`` under a score head). Returns the
    (missing, unused) keys that were allowed, for the caller's note."""
    missing = _untied(model, info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    mismatched = [m[0] if isinstance(m, (tuple, list)) else m for m in info.get("mismatched_keys") or ()]
    new = sorted(k for k in missing if k.startswith(new_ok)) if new_ok else []
    unused = sorted(k for k in unexpected if k.startswith(unused_ok)) if unused_ok else []
    missing, unexpected = missing - set(new), unexpected - set(unused)
    if not (missing or unexpected or mismatched):
        return new, unused
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} weight(s) of {type(model).__name__} are missing from the checkpoint and would start "
            f"random ({_examples(missing)})"
        )
    if unexpected:
        problems.append(f"{len(unexpected)} weight(s) in the checkpoint have no place in it ({_examples(unexpected)})")
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) have another shape ({_examples(mismatched)})")
    hint = "use a checkpoint of the architecture its config.json names, saved with all its weights"
    if any(k.startswith("score.") for k in unexpected) and any("lm_head" in k for k in missing):
        hint = (
            f"'{path}' is a reward model (a sequence-classification head, no LM head); {field} needs a causal LM "
            "such as the policy's final/ or its base model"
        )
    raise OxrlError(f"{field}: the weights in '{path}' do not match the model: {'; '.join(problems)}; {hint}")


def load_causal_lm(
    name: str,
    field: str = "model.name",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    reporter=None,
):
    """A causal LM in float32 (or ``model.dtype`` within `model_options`); a checkpoint whose weights do not
    fit the class is refused (`check_loading`). A vision-language model loads with its own class through
    `AutoModelForImageTextToText` (`vision.is_vlm_config`; a VLM of a family oxRL is not verified on is refused),
    its never-sampled tokens masked in every forward through `token_head` (`vision.placeholder_token_ids`).
    ``reporter`` (a `progress.Reporter`) shows that it is loading (a spinner, or one line)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    quiet_transformers()
    path = resolve_model_path(name)
    check_model_path(path, field)
    auto = AutoModelForImageTextToText if _is_vlm_checkpoint(path, field) else AutoModelForCausalLM
    try:
        with activity(reporter, f"loading {field} {path}"):
            model, info = auto.from_pretrained(
                path,
                dtype=_dtype(),
                revision=_revision(path),
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
            )
    except Exception as exc:  # noqa: BLE001 - from_pretrained fails in many types (OSError, ValueError, KeyError, ImportError, ...) for a bad checkpoint
        raise OxrlError(f"{field}: cannot load a causal LM from '{path}': {type(exc).__name__}: {exc}") from None
    check_loading(model, info, path, field)
    per_sequence_linear_attention(model)  # Gated DeltaNet layers restart at each sequence of a packed row
    if auto is AutoModelForImageTextToText:  # every forward scores the distribution its rollouts sample from
        choose_path(model, 0, masked=tuple(placeholder_token_ids(model.config, _tokenizer_or_none(path))))
    return model


def _tokenizer_or_none(path: str):
    """The checkpoint's tokenizer, or None where it has none that loads (the config's ids then suffice)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, revision=_revision(path))
    except Exception:  # noqa: BLE001 - no tokenizer files, an odd one: the never-sampled ids come from the config
        return None


def _is_vlm_checkpoint(path: str, field: str) -> bool:
    """True for a VLM checkpoint of a verified family (`vision.vision_family` refuses the others by name). A config
    that cannot be read here is left to ``from_pretrained``'s own message."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, revision=_revision(path))
    except Exception:  # noqa: BLE001 - remote code, an odd config: from_pretrained says what is wrong
        return False
    if not is_vlm_config(config):
        return False
    vision_family(config, field)
    return True


def _note(message: str) -> None:
    import sys

    print(message, file=sys.stderr, flush=True)


def count_parameters(model) -> int:
    """Parameters of the model (under ZeRO-3 a rank holds a slice; ``ds_numel`` is the whole size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def load_score_model(
    name: str,
    pad_token_id: int,
    field: str = "model.name",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    log=None,
    reporter=None,
):
    """A sequence-classification model with one output (a reward model), e.g. from a causal-LM
    checkpoint (the scalar head ``score`` then starts fresh, seeded by the run's seed)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    quiet_transformers()
    path = resolve_model_path(name)
    check_model_path(path, field)
    try:
        with activity(reporter, f"loading {field} {path}"):
            model, info = AutoModelForSequenceClassification.from_pretrained(
                path,
                num_labels=1,
                dtype=_dtype(),
                revision=_revision(path),
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
            )
    except Exception as exc:  # noqa: BLE001 - from_pretrained fails in many types (OSError, ValueError, KeyError, ImportError, ...) for a bad checkpoint
        raise OxrlError(
            f"{field}: cannot load a sequence-classification model from '{path}': {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(getattr(model, "score", None), torch.nn.Module):
        raise OxrlError(f"{field}: '{path}' has no per-token `score` head (a decoder reward model is expected)")
    new, unused = check_loading(model, info, path, field, new_ok=("score.",), unused_ok=("lm_head.",))
    if new:
        (log or _note)(
            f"note: {field}: '{path}' has no reward head; a new `score` head ({', '.join(new)}) starts from "
            f"random values seeded by train.seed{' and its LM head is not used' if unused else ''}"
        )
    model.config.pad_token_id = pad_token_id
    per_sequence_linear_attention(model)
    return model
