"""Tiny random-weight models of every architecture family oxRL is verified on (the test matrix).

`build_arch(family, out_dir, seed)` saves an ordinary Hugging Face directory: a 2-layer model
(hidden 64-128, head_dim 64 because vLLM's CPU kernels need it, fp32) built from the family's
own transformers config class, and a byte-level BPE tokenizer trained here with `tokenizers` on
a small built-in corpus, with the family's special tokens and chat-template style. Nothing is
downloaded. Sliding windows are set shorter than the test rows (16 tokens) so that an attention
path that drops the window computes something measurably different.

`build_broken(kind, out_dir)` saves a deliberately broken model directory for `oxrl check-model`.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

FAMILIES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3",
    "gemma3_mm",
    "mistral",
    "phi3",
    "olmo2",
    "qwen3_5",
    "qwen3_5_moe",
)

#: the families with Gated DeltaNet linear-attention layers (a recurrent state and a short causal convolution
#: along the row, which a packed row must restart at every sequence boundary)
LINEAR_ATTENTION = ("qwen3_5", "qwen3_5_moe")

#: the sliding window of the families that have one: shorter than the rows the matrix trains on
WINDOW = 16
BPE_VOCAB = 640
MAX_POSITIONS = 1024

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A model learns to add numbers one step at a time.
Question: what is the answer? Answer: the answer is a number. Please think step by step.
You are a helpful assistant. The user asks a question and the assistant answers it briefly.
Sliding window attention looks at the most recent tokens only. Packing puts several rows in one.
Reinforcement learning rewards correct answers; preference learning compares two responses.
"""


def _corpus() -> list[str]:
    lines = [f"What is {a}+{b}? {a + b}" for a in range(20) for b in range(20)]
    lines += [f"Compute {a} times {b}. The result is {a * b}." for a in range(12) for b in range(12)]
    lines += [f"The sum of {a} and {b} is {a + b}." for a in range(10) for b in range(10)]
    lines += _ENGLISH.splitlines() * 4
    return lines


# family style: special tokens, which are bos/eos/pad, the chat template and whether encoding adds BOS.
# Every template renders HF-format tool calls (an assistant message's ``tool_calls``, each
# ``{"type": "function", "function": {"name", "arguments"}}`` or flat) and ``tool`` messages in its family's
# style; a message without tool calls renders as it did before tools were added.

#: Jinja: one call (``fn``) as hermes / mistral JSON, the way the tool parsers' ``format`` writes it
_CALL_JSON = (
    "'{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + "
    "(fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson)) + '}'"
)
_FN = "{% set fn = call['function'] if call['function'] is defined else call %}"


def _hermes_calls(content: str, inner: str = "") -> str:
    """Jinja: the message's tool calls as ``<tool_call>`` blocks, each on its own line after ``content`` (an
    expression; no newline before the first call when it is empty); ``inner`` pads the JSON (Qwen: a newline)."""
    return (
        "{% for call in message['tool_calls'] or [] %}" + _FN + "{% if " + content + " or not loop.first %}"
        "{{ '\n' }}{% endif %}{{ '<tool_call>" + inner + "' + " + _CALL_JSON + " + '" + inner + "</tool_call>' }}"
        "{% endfor %}"
    )


def _tool_responses(open_turn: str, close_turn: str) -> str:
    """Jinja: a ``tool`` message as ``<tool_response>`` in a user turn; a run of them shares one turn (Qwen2.5)."""
    return (
        "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '" + open_turn + "' }}{% endif %}"
        "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
        "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '" + close_turn + "' }}{% endif %}"
    )


def _chatml(strip_earlier_thinking: bool = False) -> str:
    """ChatML in Qwen2.5's style for tools; ``strip_earlier_thinking``: Qwen3's rewriting of history, an assistant
    message that is not the conversation's last loses everything up to its ``</think>``."""
    rewrite = (
        "{% if not loop.last and message['role'] == 'assistant' and '</think>' in content %}"
        "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    )
    return (
        "{% for message in messages %}"
        "{% if message['role'] == 'tool' %}" + _tool_responses("<|im_start|>user", "<|im_end|>\n") + "{% else %}"
        "{% set content = message['content'] or '' %}" + (rewrite if strip_earlier_thinking else "") + ""
        "{{ '<|im_start|>' + message['role'] + '\n' + content }}" + _hermes_calls("content", inner="\n") + ""
        "{{ '<|im_end|>' + '\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


_CHATML = _chatml()
#: a ChatML template that, like Qwen3's, rewrites history: re-rendering a conversation drops the ``<think>`` block
#: of every assistant message but the last, so the text of earlier turns is not what the model sampled
HISTORY_REWRITING_TEMPLATE = _chatml(strip_earlier_thinking=True)
_GEMMA = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{% if role == 'system' %}{% set role = 'user' %}{% endif %}"
    "{% if role == 'tool' %}" + _tool_responses("<start_of_turn>user", "<end_of_turn>\n") + "{% else %}"
    "{% set content = (message['content'] or '') | trim %}"
    "{{ '<start_of_turn>' + role + '\n' + content }}" + _hermes_calls("content") + "{{ '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_MISTRAL = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'system' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] or '' }}"
    "{% if message['tool_calls'] %}{{ '[TOOL_CALLS][' }}"
    "{% for call in message['tool_calls'] %}" + _FN + "{% if not loop.first %}{{ ', ' }}{% endif %}"
    "{{ " + _CALL_JSON + " }}{% endfor %}{{ ']' }}{% endif %}"
    "{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}{{ '[TOOL_RESULTS] ' + message['content'] + ' [/TOOL_RESULTS]' }}"
    "{% endif %}"
    "{% endfor %}"
)
_PHI3 = (
    "{% for message in messages %}"
    "{% set content = message['content'] or '' %}"
    "{{ '<|' + message['role'] + '|>\n' + content }}" + _hermes_calls("content") + "{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

_STYLES = {
    # specials (in id order, first ids of the vocabulary), bos, eos, pad, template, add BOS when encoding
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>", _CHATML, False),
    "smollm2": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        _CHATML,
        False,
    ),
    "olmo2": (
        ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
        "<|endoftext|>",
        "<|im_end|>",
        "<|pad|>",
        _CHATML,
        False,
    ),
    "gemma": (
        ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        "<bos>",
        "<end_of_turn>",
        "<pad>",
        _GEMMA,
        True,
    ),
    "gemma_mm": (
        [
            "<pad>",
            "<eos>",
            "<bos>",
            "<unk>",
            "<start_of_turn>",
            "<end_of_turn>",
            "<start_of_image>",
            "<end_of_image>",
            "<image_soft_token>",
        ],
        "<bos>",
        "<end_of_turn>",
        "<pad>",
        _GEMMA,
        True,
    ),
    # Mistral ships no pad token: oxRL falls back to EOS, as it must for the real model
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", None, _MISTRAL, True),
    "phi3": (
        ["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        "<s>",
        "<|end|>",
        "<|endoftext|>",
        _PHI3,
        False,
    ),
}

_FAMILY_STYLE = {
    "llama": "smollm2",
    "qwen2": "chatml",
    "qwen3": "chatml",
    "qwen3_moe": "chatml",
    "olmo2": "olmo2",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3_mm": "gemma_mm",
    "mistral": "mistral",
    "phi3": "phi3",
    "qwen3_5": "chatml",
    "qwen3_5_moe": "chatml",
}


@functools.lru_cache(maxsize=None)
def _tokenizer_json(style: str) -> str:
    """Train a byte-level BPE on the built-in corpus (deterministic; milliseconds) -> tokenizer JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials, bos, _eos, _pad, _template, add_bos = _STYLES[style]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(), trainer=trainer)
    if add_bos:
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, core.token_to_id(bos))]
        )
    else:
        core.post_processor = processors.ByteLevel(trim_offsets=False)
    return core.to_str()


def build_tokenizer(family: str):
    """The family's tokenizer: a `PreTrainedTokenizerFast` with its special tokens and chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    style = _FAMILY_STYLE[family]
    specials, bos, eos, pad, template, _add_bos = _STYLES[style]
    named = {bos, eos, pad}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(style)),
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token="<unk>" if "<unk>" in specials else None,
        additional_special_tokens=[t for t in specials if t not in named and t != "<unk>"],
    )
    tokenizer.chat_template = template
    tokenizer.padding_side = "right"
    return tokenizer


def _config(family: str, tokenizer):
    """The family's transformers config: 2 layers, head_dim 64, hidden 64-128, fp32."""
    import transformers as tf

    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "max_position_embeddings": MAX_POSITIONS,
        "num_hidden_layers": 2,
    }
    if family == "llama":  # SmolLM2: tied embeddings, one KV head per query head
        return tf.LlamaConfig(
            hidden_size=64,
            intermediate_size=192,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=64,
            tie_word_embeddings=True,
            rope_theta=100000.0,
            **ids,
        )
    if family == "qwen2":  # grouped-query attention with q/k/v biases
        return tf.Qwen2Config(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            use_sliding_window=False,
            **ids,
        )
    if family == "qwen3":  # q/k norms; heads wider than the hidden size, as Qwen3 does
        return tf.Qwen3Config(
            hidden_size=64,
            intermediate_size=192,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            tie_word_embeddings=True,
            use_sliding_window=False,
            **ids,
        )
    if family == "qwen3_moe":  # 4 experts, top-2, every layer sparse
        return tf.Qwen3MoeConfig(
            hidden_size=64,
            intermediate_size=192,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            tie_word_embeddings=False,
            use_sliding_window=False,
            **ids,
        )
    if family == "gemma2":  # soft-capping (attention 50, final 30: the defaults); sliding window on layer 0
        return tf.Gemma2Config(
            hidden_size=64,
            intermediate_size=192,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            **ids,
        )
    if family in ("gemma3", "gemma3_mm"):  # sliding window on layer 0, global attention on layer 1
        text = tf.Gemma3TextConfig(
            hidden_size=64,
            intermediate_size=192,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            **ids,
        )
        if family == "gemma3":
            return text
        vision = tf.SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=1,
            image_size=56,
            patch_size=14,
        )
        return tf.Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            mm_tokens_per_image=4,
            boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
            eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
            image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
            pad_token_id=ids["pad_token_id"],
            bos_token_id=ids["bos_token_id"],
            eos_token_id=ids["eos_token_id"],
            tie_word_embeddings=True,
        )
    if family == "mistral":
        return tf.MistralConfig(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
            **ids,
        )
    if family == "phi3":  # fused qkv / gate_up projections
        return tf.Phi3Config(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=2,
            num_key_value_heads=2,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
            original_max_position_embeddings=MAX_POSITIONS,
            **ids,
        )
    if family == "olmo2":  # post-norms and q/k norms over the whole projection
        return tf.Olmo2Config(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            **ids,
        )
    if family in LINEAR_ATTENTION:  # Qwen3.5: a Gated DeltaNet layer, then full attention (gated q, partial rotary)
        linear = dict(
            hidden_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,  # two value heads per key head, as the real models have
            tie_word_embeddings=family == "qwen3_5",
            **ids,
        )
        if family == "qwen3_5":
            return tf.Qwen3_5TextConfig(intermediate_size=256, **linear)
        return tf.Qwen3_5MoeTextConfig(  # 4 experts, top-2, and the shared expert
            moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, **linear
        )
    raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


def _model_class(family: str):
    import transformers as tf

    return {
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "qwen3_moe": tf.Qwen3MoeForCausalLM,
        "gemma2": tf.Gemma2ForCausalLM,
        "gemma3": tf.Gemma3ForCausalLM,
        "gemma3_mm": tf.Gemma3ForConditionalGeneration,
        "mistral": tf.MistralForCausalLM,
        "phi3": tf.Phi3ForCausalLM,
        "olmo2": tf.Olmo2ForCausalLM,
        "qwen3_5": tf.Qwen3_5ForCausalLM,
        "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM,
    }[family]


def _save(model, tokenizer, out_dir: Path) -> Path:
    """Write to a temporary sibling then rename, so a concurrent or killed build never leaves half a model."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def build_model(family: str, seed: int = 0, tokenizer=None):
    """The family's tiny model with random weights from `seed` (fp32), and its tokenizer."""
    import torch

    tokenizer = tokenizer or build_tokenizer(family)
    config = _config(family, tokenizer)
    torch.manual_seed(seed)
    model = _model_class(family)(config).to(torch.float32)
    eos = [tokenizer.eos_token_id]
    if family.startswith("gemma"):  # Gemma stops on <end_of_turn> and <eos>
        eos.append(tokenizer.convert_tokens_to_ids("<eos>"))
    model.generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
    model.generation_config.pad_token_id = config.get_text_config().pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer


def build_arch(family: str, out_dir: Path, seed: int = 0) -> Path:
    """Save the family's tiny random-weight model + tokenizer into `out_dir` (a plain HF directory)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    model, tokenizer = build_model(family, seed=seed)
    return _save(model, tokenizer, Path(out_dir))


def build_broken(kind: str, out_dir: Path) -> Path:
    """A deliberately broken model directory: `no_chat_template` or `no_eos` (a Llama otherwise like the matrix's)."""
    import json

    if kind not in ("no_chat_template", "no_eos"):
        raise ValueError(f"unknown broken kind {kind!r}; expected 'no_chat_template' or 'no_eos'")
    model, tokenizer = build_model("llama", seed=0)
    if kind == "no_chat_template":
        tokenizer.chat_template = None
    out = _save(model, tokenizer, Path(out_dir))
    if kind == "no_eos":
        # the tokenizer has no EOS token and neither do the model's configs
        cfg_path = out / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["eos_token"] = None
        cfg_path.write_text(json.dumps(cfg, indent=2))
        special = out / "special_tokens_map.json"
        if special.exists():
            smap = json.loads(special.read_text())
            smap.pop("eos_token", None)
            special.write_text(json.dumps(smap, indent=2))
        for name in ("config.json", "generation_config.json"):
            path = out / name
            if path.exists():
                data = json.loads(path.read_text())
                data["eos_token_id"] = None
                path.write_text(json.dumps(data, indent=2))
    return out


# ----------------------------------------------------------------------------- shared by the matrix tests

LENGTH_REWARD = (
    "from oxrl_core import Reward\n\n"
    "class LengthReward(Reward):\n"
    "    name = 'length'\n\n"
    "    def score(self, prompts, completions, examples):\n"
    "        return [float(len(c)) for c in completions]\n"
)


def run_cli(alg: str, run_dir: Path, *sets: str) -> list[dict]:
    """`oxrl run --alg ALG --set ... -q -o RUN_DIR` in process (typer's runner on the real app)."""
    from conftest import read_metrics
    from typer.testing import CliRunner

    from oxrl_core.cli import app

    args = ["run", "--alg", alg, "-q", "-o", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"oxrl {' '.join(args)} failed:\n{result.output}\n{result.exception!r}"
    return read_metrics(run_dir)
