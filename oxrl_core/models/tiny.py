"""The built-in offline model: a tiny Llama with a character-level tokenizer.

Nothing here touches a hub. The model is randomly initialised from a seed, so
`oxrl run` does real work on a fresh machine; head_dim is 64 because vLLM's CPU
attention kernels refuse smaller heads. The tokenizer is a real
`PreTrainedTokenizerFast` (one token per character, special tokens for chat
roles, a Jinja chat template), so everything saved here loads with plain
`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
from pathlib import Path

from oxrl_core.data import task
from oxrl_core.data.batching import collate
from oxrl_core.data.encode import IGNORE, tokenise_messages, tokenise_prompt_response
from oxrl_core.hf_env import quiet_transformers
from oxrl_core.observability.progress import counter

#: ``<|role|>content<|end|>`` per message. An assistant message's ``tool_calls`` (HF format, ``{"function": {"name",
#: "arguments"}}`` or flat) follow its content, on a new line after non-empty content, exactly as the ``hermes`` tool
#: parser's ``format`` writes them (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per line); a
#: ``tool`` message is ``<|tool|>content<|end|>``. A message without tool calls renders as it always has.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{% if message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) }}"
    "{{ '}</tool_call>' }}"
    "{% endfor %}"
    "<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARACTERS = list(string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", ""))


def build_tokenizer():
    """Character-level fast tokenizer: every printable ASCII character is a token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    # BPE without merges is exactly a character-level model; it round-trips through save/load.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|end|>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    return tokenizer


def build_model(vocab_size: int, hidden_size: int = 128, num_layers: int = 4, max_positions: int = 512, seed: int = 0):
    """A randomly initialised Llama; head_dim is fixed at 64."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % 64:
        raise ValueError(f"hidden_size must be a multiple of 64 (head_dim 64), got {hidden_size}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=hidden_size // 64,
        head_dim=64,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model


def save_tiny_model(path: str | os.PathLike, hidden_size: int = 128, num_layers: int = 4, seed: int = 0) -> Path:
    """Build the tiny model + tokenizer and save them as an ordinary HF directory."""
    path = Path(path)
    quiet_transformers()  # no "Writing model shards" bar
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return publish_dir(path, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


def cache_dir() -> Path:
    return Path(os.environ.get("OXRL_CACHE") or Path.home() / ".cache" / "oxrl")


def default_model_dir(hidden_size: int = 128, num_layers: int = 4, seed: int = 0) -> Path:
    """Path of the built-in tiny model, created on first use (seeded, so identical everywhere)."""
    # the tokenizer's whole definition is in the key: a directory cached before a change of template or
    # vocabulary is never served for the new one
    key = {"v": 1, "h": hidden_size, "l": num_layers, "s": seed, "chars": CHARACTERS}
    key = json.dumps(key | {"specials": SPECIAL_TOKENS, "template": CHAT_TEMPLATE})
    path = cache_dir() / f"tiny-llama-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    if not (path / "config.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tiny_model(path, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    return path


#: SFT steps of the warm start that RL algorithms begin from on the built-in task
WARM_START_STEPS = 450


#: ... and the tool-use warm start that multi-turn RL (``env.name``) begins from
TOOL_WARM_START_STEPS = 170


def warm_start_path(steps: int | None = None, seed: int = 0, tools: bool = False) -> Path:
    """Where `warm_start_dir` keeps that warm start in the cache (built or not)."""
    steps = steps if steps is not None else (TOOL_WARM_START_STEPS if tools else WARM_START_STEPS)
    base = default_model_dir()
    return base.with_name(f"{base.name}-{'tools' if tools else 'warm'}{steps}-s{seed}")


def warm_start_dir(steps: int | None = None, seed: int = 0, log=None, tools: bool = False, reporter=None) -> Path:
    """The built-in tiny model after a short SFT on the built-in task's train split (cached).

    RL needs a policy that sometimes answers correctly; a random one never does. This is a
    plain masked-NLL loop (the same maths as the `sft` algorithm, written out here so the core
    does not depend on an algorithm package), deterministic on CPU, run once per cache. With
    ``tools``, the SFT is on tool-use transcripts of the products task (question, a ``calc`` call,
    its result, the answer; loss on the assistant turns): a policy that sometimes calls the tool.
    ``reporter`` (a `progress.Reporter`) shows the steps as they go (``warm start: 50/450 steps``).
    """
    steps = steps if steps is not None else (TOOL_WARM_START_STEPS if tools else WARM_START_STEPS)
    base = default_model_dir()
    path = warm_start_path(steps, seed, tools)
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    log = log or (reporter.info if reporter is not None else None)
    if log is not None:
        kind = "tool-use SFT warm start" if tools else "SFT warm start"
        log(f"first RL run on the built-in model: a {steps}-step {kind} (cached in {path})")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if tools:
        examples = [
            ex for row in task.product_rows("train") for ex in tokenise_messages(tokenizer, row["messages"], 160)[0]
        ]
    else:
        examples = tokenise_prompt_response(task.rows("train"), tokenizer, 64).examples
    sft_warm_start(model, examples, steps, seed, tokenizer.pad_token_id, reporter)
    return publish_dir(path, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


def sft_warm_start(model, examples: list[dict], steps: int, seed: int, pad_id: int, reporter=None) -> None:
    """``steps`` of plain masked-NLL SFT on ``examples`` (32 drawn at random a step, AdamW at 1e-3, the trainable
    parameters only): the warm starts' loop, deterministic on CPU. A VLM's examples bring their pixels (`collate`)."""
    import torch  # lazy: torch only when a warm start is built

    rng = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    with counter(reporter, "warm start", "steps", total=steps) as update:
        for step in range(steps):
            picks = torch.randint(len(examples), (32,), generator=rng).tolist()
            batch = collate([examples[i] for i in picks], pad_id)
            labels = batch.pop("labels")
            logits = model(**batch).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update(step + 1)


def publish_dir(path: Path, write) -> Path:
    """``write(tmp)`` fills a temporary sibling of ``path``, then it is renamed to ``path``; when another process
    published ``path`` first, theirs is kept. Returns ``path``."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    try:
        os.replace(tmp, path)  # atomic; fails when another process published a (non-empty) ``path`` first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not path.is_dir():  # not a lost race: a real failure (full disk, permissions)
            raise
    return path
