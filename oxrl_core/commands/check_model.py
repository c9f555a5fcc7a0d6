"""`oxrl check-model PATH`: what oxRL will do with a model, before any training.

Loads the model (fp32 on CPU, the way a run loads it) and its tokenizer, and reports: the
architecture, sizes, vocabulary (embedding rows vs tokenizer), the chat template (does it render a
two-turn conversation and a generation prompt, and does the rendered prompt lead into the
assistant's turn the way the conversation does; one that does not compile or raises on them is an error,
as a run refuses it), the special tokens, the attention layout (head_dim,
heads, KV heads, sliding window, soft-capping), MoE experts, and which oxRL paths apply: packing and
shared-prefix attention (`packed_attention.attention_fast_paths`), the hf backend's prefill-once KV
cache, LoRA's default targets (`lora.default_targets`), the critic, the chunked logits head
(`token_head.choose_path`) and vLLM on CPU. Each problem comes with its fix; ``errors`` are the ones
oxRL cannot train with (the command then exits with status 2), ``warnings`` the rest.

A vision-language model (`vision.is_vlm_config`) loads with its own class, as `vision.load_vlm` loads it, and
its processor with `vision.load_processing`; the report then has a ``vision`` section (the family, the vision tower
and projector, the processor, the image token and placeholder, image tokens per sample image, the extra inputs) and
the image paths; the language-model parts come from its text config and language model. A VLM of a family oxRL has
not been verified on is an error naming the verified ones (`vision.FAMILIES`), and is not loaded.

A directory or config that cannot be read at all is an `OxrlError` (one line, no table).
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from oxrl_core.chat_templates import PROBE, describe_error, render_problem, template_source
from oxrl_core.chat_templates import names as template_names
from oxrl_core.config import LoraConfig, ModelConfig, TrainConfig
from oxrl_core.errors import OxrlError
from oxrl_core.hf_env import quiet_transformers
from oxrl_core.models import vision
from oxrl_core.models.linear_attention import per_sequence_linear_attention
from oxrl_core.models.loading import _check_local_dir, resolve_model_path
from oxrl_core.models.lora import default_targets
from oxrl_core.models.packed_attention import attention_fast_paths, packed_attn_implementation
from oxrl_core.models.packing_probe import probe
from oxrl_core.models.token_head import choose_path, full_logits_mb, vocab_size

#: head sizes vLLM's CPU attention kernels support (vllm/v1/attention/backends/cpu_attn.py, vLLM 0.32)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _one_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _problem(problems: list, severity: str, problem: str, fix: str) -> None:
    problems.append({"severity": severity, "problem": problem, "fix": fix})


def _load_config(path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    quiet_transformers()
    _check_local_dir(path, "check-model")
    local = Path(path).expanduser()
    if local.exists() and not local.is_dir():
        raise OxrlError(f"check-model: '{path}' is a file; give the model directory (the one holding config.json)")
    if local.is_dir() and not (local / "config.json").is_file():
        raise OxrlError(f"check-model: '{path}' has no config.json: not a Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(str(local) if local.is_dir() else path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - garbage json, unknown model_type, offline hub: one message
        where = local / "config.json" if local.is_dir() else path
        raise OxrlError(f"check-model: cannot read the model config {where}: {_one_line(exc)}") from None


def _chat_template(tokenizer, path: str, problems: list) -> dict:
    """Present, renders the conversation and a generation prompt, and the prompt is a prefix of the conversation.
    A template that does not compile or raises on them is an error: a run refuses it at start-up."""
    info = {
        "present": bool(getattr(tokenizer, "chat_template", None)),
        "renders_conversation": False,
        "renders_generation_prompt": False,
        "generation_header": "",
        "completion_follows": False,
        "prompt_tail": "",
    }
    if not info["present"]:
        _problem(
            problems,
            "warning",
            "the tokenizer has no chat template: chat-format rows (`messages`, prompt lists) cannot be rendered "
            "and plain-string prompts are used as they are",
            "set `chat_template` in tokenizer_config.json (e.g. copy the instruct model's), or train on plain-text "
            "prompts (oxRL then encodes the prompt string as it is)",
        )
        return info
    # the check a run makes when it loads the tokenizer (`models.load_tokenizer`): a run refuses this template
    problem = render_problem(tokenizer)
    if problem:
        _problem(
            problems,
            "error",
            f"the chat template ({template_source(path)}) {problem}",
            "fix the template there, or set model.chat_template to a Jinja file or a built-in "
            f"({', '.join(template_names())})",
        )
        return info
    conversation = tokenizer.apply_chat_template(PROBE, tokenize=False)
    info["renders_conversation"] = "2+3" in conversation and "5" in conversation.split("2+3", 1)[1]
    prompt = tokenizer.apply_chat_template(PROBE[:1], tokenize=False, add_generation_prompt=True)
    try:
        plain = tokenizer.apply_chat_template(PROBE[:1], tokenize=False, add_generation_prompt=False)
    except Exception as exc:  # noqa: BLE001 - renders with the generation prompt but raises without it
        _problem(
            problems,
            "warning",
            f"the chat template fails on a user turn without the generation prompt: {describe_error(exc)}",
            "fix `chat_template` in tokenizer_config.json",
        )
        return info
    info["renders_generation_prompt"] = "2+3" in prompt
    info["generation_header"] = prompt[len(plain) :] if prompt.startswith(plain) else prompt  # '' for Mistral's [INST]
    info["prompt_tail"] = prompt[-24:]
    eos = tokenizer.eos_token
    # the completion is appended to the rendered prompt: the template's own assistant turn must start the same way
    rest = conversation[len(prompt) :] if conversation.startswith(prompt) else None
    info["completion_follows"] = (
        rest is not None and rest.lstrip().startswith("5") and not (eos and prompt.rstrip().endswith(eos))
    )
    if not info["renders_conversation"] or not info["renders_generation_prompt"]:
        _problem(
            problems,
            "warning",
            "the chat template does not render the messages' content",
            "fix `chat_template` in tokenizer_config.json",
        )
    elif not info["completion_follows"]:
        _problem(
            problems,
            "warning",
            f"the rendered prompt (…{info['prompt_tail']!r}) is not how the template's own "
            "conversation continues into the assistant turn: a completion appended to it is not a turn the "
            "template would produce",
            "fix the template's `add_generation_prompt` branch to open the assistant turn",
        )
    return info


def _tokens(tokenizer, problems: list) -> dict:
    def token(attr):
        return {"token": getattr(tokenizer, f"{attr}_token", None), "id": getattr(tokenizer, f"{attr}_token_id", None)}

    info = {"eos": token("eos"), "pad": token("pad"), "bos": token("bos")}
    info["pad_is_eos"] = info["pad"]["id"] is not None and info["pad"]["id"] == info["eos"]["id"]
    if info["eos"]["id"] is None:
        _problem(
            problems,
            "error",
            "the tokenizer has no EOS token: oxRL ends every completion with EOS and stops sampling on it",
            "set `eos_token` in tokenizer_config.json (e.g. the template's end-of-turn token)",
        )
    elif info["pad"]["id"] is None:
        info["pad"] = dict(info["eos"])
        info["pad_is_eos"] = True
        _problem(
            problems,
            "note",
            "the tokenizer has no pad token",
            "nothing to do: oxRL uses EOS as pad (padding is masked out)",
        )
    return info


def _attention(text) -> dict:
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None)
    window = getattr(text, "sliding_window", None)
    layer_types = list(getattr(text, "layer_types", None) or ())
    if window and getattr(text, "use_sliding_window", True) is False and "sliding_attention" not in layer_types:
        window = None  # Qwen2/Qwen3 carry a window they do not use
    return {
        "hidden_size": hidden,
        "num_layers": getattr(text, "num_hidden_layers", None),
        "num_heads": heads,
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "sliding_window": window or None,
        "sliding_layers": sum(t == "sliding_attention" for t in layer_types) if window and layer_types else None,
        "attn_logit_softcapping": getattr(text, "attn_logit_softcapping", None),
        "final_logit_softcapping": getattr(text, "final_logit_softcapping", None),
    }


def _moe(text) -> dict | None:
    experts = next(
        (getattr(text, k) for k in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(text, k, None)),
        None,
    )
    if not experts:
        return None
    per_token = next((getattr(text, k) for k in ("num_experts_per_tok", "moe_topk") if getattr(text, k, None)), None)
    return {"num_experts": experts, "experts_per_token": per_token}


def _packing_probe(model, shared_prefix: bool):
    """The run's load-time packing probe (`packing_probe.probe`) on the model as a packing run loads it: linear-attention
    layers per sequence, sdpa as oxRL's packed sdpa."""
    per_sequence_linear_attention(model)
    attn = getattr(model.config, "_attn_implementation", None)
    packed = packed_attn_implementation(attn) if attn == "sdpa" else attn
    if packed != attn:
        model.set_attn_implementation(packed)
    try:
        return probe(model, shared_prefix=shared_prefix)
    finally:
        if packed != attn:
            model.set_attn_implementation(attn)


def _prefill_cache(model, config) -> tuple[bool, str]:
    """The hf backend's prefill-once cache (`HFRolloutBackend._prefilled_cache`): only plain full-attention caches."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is None or not supports():
        return False, f"{type(model).__name__} needs its own cache type: transformers' default generate path"
    try:
        cache = DynamicCache(config=config)
    except Exception as exc:  # noqa: BLE001 - any failure means the default generate path, reported, not raised
        return (
            False,
            f"transformers cannot lay a cache out for this config ({type(exc).__name__}): default generate path",
        )
    kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if not cache.layers or kinds:
        return (
            False,
            f"cache layers {', '.join(kinds) or 'none'} (sliding window / linear attention): default generate path",
        )
    return True, "prompts prefilled once per group, preallocated KV buffers"


def _lora(model, vision_parts: tuple[str, ...] = ()) -> tuple[bool, str, list[str]]:
    """LoRA's default targets; ``vision_parts``: a VLM's vision tower and projector (module names), named among the
    parts left out when no target lies inside them."""
    target = LoraConfig().target_modules
    if target != "all-linear":
        wanted = {target} if isinstance(target, str) else set(target)
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in wanted})
        return bool(names), f"lora.target_modules default {target}", names
    full = default_targets(model)
    names = sorted({n.rsplit(".", 1)[-1] for n in full})
    if not full:
        return False, "no nn.Linear layer in the language model: set lora.target_modules explicitly", []
    excluded = [
        p
        for p in ("experts", "vision_tower", "multi_modal_projector")
        if any(p in n.split(".") for n, _ in model.named_modules())
    ]
    in_vision = [n for n in full if any(n.startswith(f"{part}.") for part in vision_parts)]
    if vision_parts and not in_vision:
        excluded += [p for p in (part.rsplit(".", 1)[-1] for part in vision_parts) if p not in excluded]
    detail = f"all-linear: {len(full)} layers ({', '.join(names)})"
    if vision_parts:
        detail += (
            f", {len(in_vision)} of them in the vision tower / projector" if in_vision else ", the language model only"
        )
    if excluded:
        detail += f"; left out: {', '.join(excluded)}"
    return True, detail, names


def _chunked_head(model) -> tuple[bool, str]:
    chunk = TrainConfig().logits_chunk_size
    if chunk <= 0:
        return False, "train.logits_chunk_size default is 0: full logits"
    notes = []
    path = choose_path(model, chunk, log=notes.append)
    if not path.chunked:
        return False, f"full-vocabulary logits ({path.note})"
    extra = [f"soft-cap {path.softcap}" if path.softcap else "", f"scale {path.scale:g}" if path.scale != 1.0 else ""]
    extra = ", ".join(e for e in extra if e)
    min_mb = TrainConfig().logits_chunk_min_mb
    from_tokens = int(min_mb / full_logits_mb(1, vocab_size(model))) + 1
    return True, (
        f"{chunk} tokens per chunk" + (f" ({extra})" if extra else "") + ", probe matches the model's logits; "
        f"used from {from_tokens:,} scored tokens per micro-batch (full logits over train.logits_chunk_min_mb "
        f"{min_mb:g} MB)"
    )


# ---------------------------------------------------------------------- vision-language models

#: the square RGB images whose image-token counts the report gives (a ``grid`` or ``tiles`` family's depend on size)
SAMPLE_IMAGES = ((32, 32), (64, 64))
#: what oxRL does with images, per path
IMAGE_TRAINING = "SFT, KD and preference training (DPO/IPO/ORPO/KTO/SimPO)"
IMAGE_PACKING = "rows with images step aside to padding"


def _module(name: str, module) -> dict:
    return {"module": name, "class": type(module).__name__, "parameters": sum(p.numel() for p in module.parameters())}


def _vision_family(config, problems: list) -> dict:
    """The family of a VLM config and whether oxRL is verified on it (`vision.vision_family`); an unverified one is
    an error naming the verified families."""
    info = {"family": config.model_type, "verified": True, "verified_families": list(vision.FAMILIES)}
    try:
        vision.vision_family(config, "check-model")
    except OxrlError as exc:
        info["verified"] = False
        _problem(
            problems,
            "error",
            str(exc).removeprefix("check-model: "),
            f"use a VLM of a verified family ({', '.join(vision.FAMILIES)}), or add the family: a row in "
            "oxrl_core/models/vision.py FAMILIES and a tiny model in tests/vlm_archs.py",
        )
    return info


def _vision_parts(model, config) -> dict:
    """The vision tower (the outermost module built from the config's ``vision_config``), the projector (the
    tower's siblings with parameters, other than the language model) and the language model, by module name."""
    vision_config = getattr(config, "vision_config", None)
    modules = dict(model.named_modules())
    towers = [
        name
        for name, module in modules.items()
        if name and vision_config is not None and type(getattr(module, "config", None)) is type(vision_config)
    ]
    towers = towers or [n for n in modules if n.rsplit(".", 1)[-1] in ("visual", "vision_tower", "vision_model")]
    tower = min(towers, key=lambda n: n.count("."), default=None)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    language = next((n for n, m in modules.items() if decoder is not None and m is decoder), None)
    projector = None
    if tower is not None:
        parent = tower.rpartition(".")[0]
        text_parts = {
            id(m) for m in (decoder, model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
        }
        for child, module in modules[parent].named_children():
            name = f"{parent}.{child}" if parent else child
            if name == tower or any(id(m) in text_parts for m in module.modules()):
                continue
            if any(True for _ in module.parameters()):
                projector = name
                break
    info = {
        "tower": _module(tower, modules[tower]) if tower is not None else None,
        "projector": _module(projector, modules[projector]) if projector else None,
        "language_model": _module(language, decoder) if language is not None else None,
    }
    if info["tower"]:
        info["tower"]["config_model_type"] = getattr(vision_config, "model_type", None)
    return info


def _vision_processing(report: dict, config, path: str, tokenizer, problems: list) -> None:
    """The processor, the image token, how many image tokens the sample images become, and the image paths."""
    info, paths = report["vision"], report["paths"]
    family = vision.vision_family(config, "check-model")
    info.update(
        processor=None,
        image_token=None,
        placeholder=family.placeholder,
        tokens=family.tokens,
        tokens_per_image=None,
        extra_inputs=list(family.extra_inputs),
        pixels_by=family.pixels_by,
    )
    processing = None
    try:
        processing = vision.load_processing(path, "check-model")
    except Exception as exc:  # noqa: BLE001 - text rows still train: reported, the check goes on
        _problem(
            problems,
            "warning",
            f"cannot load the processor ({_one_line(exc)}): rows with images cannot be encoded (text rows can)",
            "save the model's processor beside it (processor.save_pretrained(dir)), or at least its image "
            "processor (preprocessor_config.json)",
        )
    try:
        token_id = vision.image_token_id(config)
    except OxrlError as exc:
        _problem(problems, "error", str(exc), "set image_token_id in config.json to the processor's image token")
        token_id = None
    tok = processing.tokenizer if processing is not None else tokenizer
    if token_id is not None:
        info["image_token"] = {
            "token": tok.convert_ids_to_tokens(token_id) if tok is not None else None,
            "id": token_id,
        }
    why = "no processor" if processing is None else _processor(info, processing, problems)
    _image_paths(paths, family, why)


def _processor(info: dict, processing, problems: list) -> str | None:
    """The loaded processor in the report, and the image tokens it makes of the sample images; returns why rows
    with images cannot be encoded, None when they can."""
    from PIL import Image

    why = None
    processor = processing.processor
    image_processor = getattr(processor, "image_processor", None)
    info["processor"] = {
        "class": type(processor).__name__,
        "image_processor": type(image_processor).__name__ if image_processor is not None else None,
        # `vision.images_only`'s class: the processor built from its tokenizer and image processor alone
        "without_video": type(processor).__module__ == vision.__name__,
        "torchvision": find_spec("torchvision") is not None,
    }
    if image_processor is None:  # e.g. `AutoProcessor` gave the tokenizer alone
        why = f"{type(processor).__name__} has no image processor"
        _problem(
            problems,
            "warning",
            f"the processor ({type(processor).__name__}) has no image processor: rows with images cannot be "
            "encoded (text rows can)",
            "save the model's image processor beside it (preprocessor_config.json)",
        )
    else:
        try:
            counts = {
                f"{w}x{h}": processing.tokens_per_image(Image.new("RGB", (w, h), (128, 128, 128)))
                for w, h in SAMPLE_IMAGES
            }
        except Exception as exc:  # noqa: BLE001 - the processor's own failure, reported rather than raised
            why = "the processor fails on an image"
            _problem(
                problems,
                "warning",
                f"the processor fails on a {SAMPLE_IMAGES[0][0]}×{SAMPLE_IMAGES[0][1]} image: {_one_line(exc)}",
                "check the processor's files (preprocessor_config.json, processor_config.json)",
            )
        else:
            info["tokens_per_image"] = counts
            if not all(counts.values()):
                why = "the processor makes no image tokens"
                _problem(
                    problems,
                    "warning",
                    f"the processor turns a sample image into no image token (id {processing.image_token_id}): "
                    "the model would see no image",
                    "the processor's image token must be the config's image_token_id / image_token_index",
                )
    return why


def _image_paths(paths: dict, family, why: str | None) -> None:
    """The image paths of the report: training on rows with images (unless ``why``), packing them, the vision
    tower's freezing."""
    paths["images"] = {
        "applies": why is None,
        "detail": IMAGE_TRAINING if why is None else f"{why}: rows with images cannot be encoded",
    }
    if family.model_type in getattr(vision, "PACKS", ()):  # the families whose packed rows are exact
        paths["image_packing"] = {
            "applies": True,
            "detail": "SFT packs rows with images exactly (each packed row its own rotary positions); "
            "the other loops pad them",
        }
    else:
        qwen = " (Qwen-VL: exact 4-row positions planned)" if family.model_type.startswith("qwen") else ""
        paths["image_packing"] = {"applies": False, "detail": IMAGE_PACKING + qwen}
    freeze = ModelConfig.model_fields.get("freeze_vision")
    paths["freeze_vision"] = (
        {"applies": False, "detail": "no model.freeze_vision in this oxRL's config"}
        if freeze is None
        else {
            "applies": bool(freeze.default),
            "detail": "the vision tower is frozen by default (model.freeze_vision: true)"
            if freeze.default
            else "the vision tower trains by default (model.freeze_vision: false)",
        }
    )


# ---------------------------------------------------------------------- the report


def check_model(name: str, trust_remote_code: bool = False) -> dict:
    """The report `oxrl check-model` prints (a JSON-ready dict); ``ok`` is False when oxRL cannot train the model."""
    path = resolve_model_path(name)
    config = _load_config(path, trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems: list[dict] = []
    report: dict = {
        "path": path,
        "architecture": (getattr(config, "architectures", None) or [None])[0],
        "model_type": getattr(config, "model_type", None),
        "text_model_type": getattr(text, "model_type", None),
        "nested_text_config": text is not config,
        "parameters": None,
        "vocab": {"config": getattr(text, "vocab_size", None), "embedding_rows": None, "tokenizer": None},
        "attention": _attention(text),
        "moe": _moe(text),
        "max_positions": getattr(text, "max_position_embeddings", None),
        "tied_embeddings": bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))),
        "tokens": None,
        "chat_template": None,
        "paths": {},
        "lora_targets": [],
        "problems": problems,
    }

    tokenizer = _tokenizer(report, path, trust_remote_code, problems)
    vlm = vision.is_vlm_config(config)
    if vlm:
        report["vision"] = _vision_family(config, problems)  # an unverified family is refused: not loaded
    model, loading = _load_model(report, path, trust_remote_code, vlm, problems)
    if model is not None:
        _loaded_model(report, model, loading, config, text, problems)
        del model
    if vlm and report["vision"]["verified"]:
        _vision_processing(report, config, path, tokenizer, problems)

    rows, tok = report["vocab"]["embedding_rows"], report["vocab"]["tokenizer"]
    if rows is not None and tok is not None and tok > rows:
        _problem(
            problems,
            "error",
            f"the tokenizer has {tok} tokens but the embedding only {rows} rows: "
            "token ids ≥ {rows} index out of range".replace("{rows}", str(rows)),
            "resize the embeddings (model.resize_token_embeddings(len(tokenizer))) and save, or use the model's own tokenizer",
        )
    report["ok"] = not any(p["severity"] == "error" for p in problems)
    return report


def _tokenizer(report: dict, path: str, trust_remote_code: bool, problems: list):
    """The tokenizer as a run loads it, with its vocabulary, special tokens and chat template in the report; None
    (an error reported) when it cannot be loaded."""
    from transformers import AutoTokenizer

    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any load failure is one reported problem; the check goes on
        _problem(
            problems,
            "error",
            f"cannot load the tokenizer: {_one_line(exc)}",
            "save the tokenizer next to the model (tokenizer.save_pretrained(dir))",
        )
    if tokenizer is not None:
        report["vocab"]["tokenizer"] = len(tokenizer)
        report["tokens"] = _tokens(tokenizer, problems)
        report["chat_template"] = _chat_template(tokenizer, path, problems)
    return tokenizer


def _load_model(report: dict, path: str, trust_remote_code: bool, vlm: bool, problems: list):
    """The model and its loading info (missing weights), loaded as a run loads it: a VLM of a verified family with
    its own class, a text model as a causal LM; ``(None, None)`` (an error reported, or an unverified VLM family)
    when there is none to check."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if vlm and report["vision"]["verified"]:
        report["vision"].update(tower=None, projector=None, language_model=None)
        try:  # as `vision.load_vlm` loads it (its own class, float32), with the loading info for missing weights
            return AutoModelForImageTextToText.from_pretrained(
                path, dtype=torch.float32, trust_remote_code=trust_remote_code, output_loading_info=True
            )
        except Exception as exc:  # noqa: BLE001 - any load failure is one reported problem; the check goes on
            _problem(
                problems,
                "error",
                f"cannot load the vision-language model: {_one_line(exc)}",
                "oxRL loads VLMs with AutoModelForImageTextToText: check the weights files and "
                "`architectures`/`model_type` in config.json",
            )
    elif not vlm:
        try:
            return AutoModelForCausalLM.from_pretrained(
                path,
                dtype=torch.float32,
                attn_implementation="sdpa",
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
            )
        except Exception as exc:  # noqa: BLE001 - any load failure is one reported problem; the check goes on
            _problem(
                problems,
                "error",
                f"cannot load a causal LM: {_one_line(exc)}",
                "oxRL trains models AutoModelForCausalLM can load: check the weights files and "
                "`architectures`/`model_type` in config.json (custom code needs trust_remote_code)",
            )
    return None, None


def _loaded_model(report: dict, model, loading: dict, config, text, problems: list) -> None:
    """What the loaded model tells: its class and size, missing weights, its head and embedding, a VLM's parts,
    and which oxRL paths apply to it (`_paths`)."""
    report["architecture"] = type(model).__name__ if report["architecture"] is None else report["architecture"]
    report["loaded_class"] = type(model).__name__
    report["parameters"] = sum(p.numel() for p in model.parameters())
    missing = list(loading.get("missing_keys") or [])
    if missing:
        _problem(
            problems,
            "error",
            f"{len(missing)} weights missing from the checkpoint (e.g. {missing[0]}): "
            "from_pretrained initialises them at random",
            "re-save the model with all its weights (a LoRA export must be merged)",
        )
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if head is None:
        _problem(
            problems,
            "error",
            f"{type(model).__name__} has no LM head (output embeddings)",
            "use a causal-LM checkpoint (…ForCausalLM / …ForConditionalGeneration)",
        )
    if embed is not None:
        report["vocab"]["embedding_rows"] = int(embed.weight.shape[0])
    parts = ()
    if "vision" in report:
        report["vision"].update(_vision_parts(model, config))
        parts = tuple(p["module"] for p in (report["vision"]["tower"], report["vision"]["projector"]) if p)
    _paths(report, model, config, text, problems, parts)


def _paths(report: dict, model, config, text, problems: list, vision_parts: tuple[str, ...] = ()) -> None:
    paths = report["paths"]
    for key, (applies, detail) in attention_fast_paths(config).items():
        paths[key] = {"applies": applies, "detail": detail}
    verdict = _packing_probe(model, paths["shared_prefix"]["applies"])
    measured = (
        ("packing", verdict.packing, "packing", "its rows are padded"),
        ("shared_prefix", verdict.shared_prefix, "shared prompts", "they do not apply"),
    )
    for key, passed, what, then in measured:
        if not paths[key]["applies"]:
            continue
        if passed:
            paths[key]["detail"] += "; measured: a packed row = the separate forwards"
        else:
            paths[key] = {"applies": False, "detail": verdict.note(what, then)}
    applies, detail = _prefill_cache(model, config)
    if applies and not verdict.packing:
        applies, detail = False, verdict.note("the prefill-once cache", "it generates with transformers' own cache")
    paths["hf_prefill_cache"] = {"applies": applies, "detail": detail}
    applies, detail, names = _lora(model, vision_parts)
    paths["lora"] = {"applies": applies, "detail": detail}
    report["lora_targets"] = names
    hidden = getattr(text, "hidden_size", None)
    paths["critic"] = (
        {"applies": True, "detail": f"value head on hidden size {hidden} (text config)"}
        if hidden
        else {"applies": False, "detail": "no hidden_size in the text config: PPO's critic cannot be built"}
    )
    try:
        applies, detail = _chunked_head(model)
    except Exception as exc:  # noqa: BLE001 - the probe is the trainer's own; report it rather than crash
        applies, detail = False, f"probe failed ({type(exc).__name__}: {exc}): full logits"
    paths["chunked_logits"] = {"applies": applies, "detail": detail}
    head_dim = report["attention"]["head_dim"]
    if head_dim in VLLM_CPU_HEAD_SIZES:
        paths["vllm_cpu"] = {"applies": True, "detail": f"head_dim {head_dim} is supported by vLLM's CPU kernels"}
    else:
        paths["vllm_cpu"] = {
            "applies": False,
            "detail": f"head_dim {head_dim} is not one of vLLM's CPU kernel sizes "
            f"({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); vLLM on a GPU may still run it",
        }
        _problem(
            problems,
            "warning",
            f"rollout.backend=vllm cannot run this model on CPU (head_dim {head_dim})",
            "use rollout.backend=hf on CPU (the default), or vLLM on a GPU",
        )
    if not hidden:
        _problem(
            problems,
            "warning",
            "no hidden_size in the text config: PPO's critic cannot be built",
            "use an algorithm without a critic (GRPO-style: sgrpo, cispo)",
        )
    softcap = report["attention"]["attn_logit_softcapping"]
    if softcap is not None:
        _problem(
            problems,
            "warning",
            f"attention soft-capping ({softcap}) is skipped by sdpa attention (transformers' "
            "own behaviour, padded and packed alike)",
            "set model.attn_implementation=eager to apply it (slower)",
        )
