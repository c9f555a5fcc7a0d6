"""Peak memory at a real vocabulary: oxRL (chunked LM head, and with it off) vs TRL 1.16, SFT / DPO / SGRPO / VLM SFT.

Each configuration runs in a fresh subprocess (this script with ``--child``), so its peak is its
own: the child's peak resident set (``ru_maxrss``, CPU) or ``torch.cuda.max_memory_allocated``
(GPU), for the whole process — imports, model, optimiser state, data and the training steps.

Workload: a Llama with a 151,936-token vocabulary (Qwen2.5's), 2 layers, hidden 128, untied
embeddings (39M parameters, nearly all in the embedding and the LM head), the built-in
character tokenizer (so a row of N characters is ~N tokens); fp32 (CPU) or bf16 autocast (GPU);
AdamW, lr 1e-5, grad clipping 1.0, no activation checkpointing anywhere, batch 2:

  sft    2 rows of ~2,000 tokens (a 200-token prompt, masked; a 1,800-token response)
         oxrl: `oxrl_core.Trainer(alg="sft")`; trl: `SFTTrainer` (completion-only loss, no packing)
  dpo    2 pairs, each ~2,000 tokens (a 200-token prompt, chosen and rejected ~900 tokens each)
         oxrl: `Trainer(alg="dpo")` (reference model: a frozen copy); trl: `DPOTrainer(ref_model=None)`
  sgrpo  one update step on a fixed rollout: 2 samples of one 200-token prompt, 1,800-token
         completions, rewards 1 and 0 (no generation is timed or measured)
         oxrl: the RL loop's single-pass update (`loops.rl._forward` with the token-mean SGRPO loss,
         logp_old = the same forward's logp, detached); trl: `GRPOTrainer.compute_loss` with
         `loss_type="dapo"` (the same token-mean clipped objective) on the same tensors
  vlm    SFT of a vision-language model on image rows: a Gemma-3 (`Gemma3ForConditionalGeneration`
         built from its config classes, random weights) with Gemma-3's 262,208-token vocabulary, the
         language model at --hidden × --layers (tied embeddings: 34.2M parameters at the defaults), a
         2-layer SigLIP tower on 64×64 pictures (16 image tokens each, frozen: oxRL's default, and the
         same parameters frozen on the TRL side); the tests' Gemma-3 tokenizer and chat template
         (`tests/vlm_archs.py`) and its PIL processor (no torchvision); 16 rows of one picture and a
         question (90 prompt tokens, the picture's 16 included) and a ~850-token response (--vlm-row-tokens
         1000: ~940 tokens a row); batch 2
         oxrl: `Trainer(alg="sft")` on the rows (each prompt through the model's processor);
         trl: `SFTTrainer` with the processor as `processing_class` and an `images` column (its
         vision collator), in TRL's standard prompt-completion format: the prompt as the processor's
         chat template renders it, the completion the response + EOS, in the order oxRL deals the rows.
         Before the runs, TRL's collator is checked to give, row by row, oxRL's token ids, labels,
         token_type_ids and pixels; after them, the two step-1 losses must agree (≤ 1e-4 fp32), and
         the later steps' loss gaps are printed (the same trainable parameters and AdamW: ~1e-6 on CPU).
         oxRL trains a VLM's policy without the tokens it never samples (their logits masked), so the
         loss check runs TRL a second time, unmeasured, on that objective (``trl-masked``: its
         `compute_loss_func` route on the full logits, the tokens masked by a hook); the measured
         ``trl`` side is TRL's default route (its fused LM head), whose loss includes their mass.

Sides: ``oxrl`` (the default, ``train.logits_chunk_size`` 1024), ``oxrl-plain``
(``train.logits_chunk_size=0``: the model's full logits, what oxRL did before) and ``trl``.
Printed per workload: peak GB, tokens/s over the measured steps (after ``--warmup``), and the
ratios oxrl / trl and oxrl / oxrl-plain; then one JSON line with every figure.

    python benchmarks/memory.py                          # all four workloads, all sides (CPU: ~25 min; oxrl-plain
                                                         # SGRPO alone peaks near 19 GB: run it on a quiet machine)
    python benchmarks/memory.py --only sft --steps 3
    python benchmarks/memory.py --only vlm --threads 1                   # the VLM row alone (CPU: ~7 min, shared)
    python benchmarks/memory.py --sides oxrl,trl --chunk 512
    python benchmarks/memory.py --only sft,vlm --sides oxrl --vlm-sides oxrl,trl     # TRL on the VLM row only

TRL is a benchmark-only dependency (`pip install trl`); without it the TRL side is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sft_throughput import _filler  # the benchmarks' shared row filler

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = ("sft", "dpo", "sgrpo", "vlm")
SIDES = ("oxrl", "oxrl-plain", "trl")
IGNORE = -100


# ----------------------------------------------------------------------------- workload


def setup(workdir: Path, args) -> None:
    """The model (151,936-token vocabulary) with the built-in character tokenizer, and the rows."""
    from oxrl_core.models.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(args.vocab, hidden_size=args.hidden, num_layers=args.layers, max_positions=4096, seed=0)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(workdir / "model")
    tokenizer.save_pretrained(workdir / "model")
    rng = random.Random(args.seed)
    prompt = lambda: "Continue the chain. " + _filler(rng, args.prompt_tokens - 40)
    sft = [
        {"prompt": prompt(), "response": _filler(rng, args.row_tokens - args.prompt_tokens)}
        for _ in range(args.batch * 8)
    ]
    half = (args.row_tokens - args.prompt_tokens) // 2
    dpo = [
        {"prompt": prompt(), "chosen": _filler(rng, half), "rejected": _filler(rng, half - 7)}
        for _ in range(args.batch * 8)
    ]
    for name, rows in (("sft", sft), ("dpo", dpo)):
        (workdir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (workdir / "sgrpo.json").write_text(
        json.dumps(
            {
                "prompt": prompt(),
                "completions": [_filler(rng, args.row_tokens - args.prompt_tokens) for _ in range(args.batch)],
            }
        )
    )


def _train_cfg(args, steps: int, chunk: int) -> dict:
    return {
        "max_steps": steps,
        "batch_size": args.batch,
        "lr": 1e-5,
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "seed": args.seed,
        "save_every": 0,
        "logits_chunk_size": chunk,
    }


# ----------------------------------------------------------------------------- oxRL


def oxrl_sl(workload: str, args, workdir: Path, chunk: int) -> dict:
    """SFT or DPO through `oxrl_core.Trainer` (the CLI's code path); tokens/s from its metrics. ``vlm``: SFT of the
    Gemma-3 VLM on the image rows (the vision tower frozen, oxRL's default, unless ``--vlm-train-vision``)."""
    from oxrl_core import Trainer

    out = workdir / f"run-{workload}-{chunk}"
    shutil.rmtree(out, ignore_errors=True)
    if workload == "vlm":
        alg, model = "sft", {"name": str(workdir / "vlm-model"), "freeze_vision": not args.vlm_train_vision}
    else:
        alg, model = workload, str(workdir / "model")
    trainer = Trainer(
        alg=alg,
        model=model,
        data={"train": str(workdir / f"{workload}.jsonl"), "max_length": 4096},
        output_dir=out,
        quiet=True,
        train=_train_cfg(args, args.warmup + args.steps, chunk),
        engine={"device": args.device},
    )
    metrics = trainer.train().metrics
    records = metrics[args.warmup :]
    return {
        "tokens": sum(r["perf/tokens"] for r in records),
        "seconds": sum(r["perf/step_s"] for r in records),
        "loss": records[-1]["loss"],
        "first_loss": metrics[0]["loss"],  # step 1's, computed before the first update
        "losses": [r["loss"] for r in metrics],
    }


def rollout_rows(workdir: Path):
    """The fixed rollout: prompt token ids (chat template + generation prompt) and completion token ids (+ EOS)."""
    from transformers import AutoTokenizer

    from oxrl_core.data.encode import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    spec = json.loads((workdir / "sgrpo.json").read_text())
    prompt_ids = encode_prompt(tokenizer, spec["prompt"])
    completions = [
        tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for c in spec["completions"]
    ]
    return tokenizer, prompt_ids, completions


def oxrl_sgrpo(args, workdir: Path, chunk: int) -> dict:
    import torch

    from oxrl_algs_rl.sgrpo import SGRPO
    from oxrl_core.interfaces import Completion
    from oxrl_core.models.loading import load_causal_lm
    from oxrl_core.models.token_head import choose_path
    from oxrl_core.rl.batch import policy_forward as _forward
    from oxrl_core.rl.batch import rollout_tensors

    tokenizer, prompt_ids, completions = rollout_rows(workdir)
    device = torch.device(args.device)
    model = load_causal_lm(str(workdir / "model"))
    choose_path(model, chunk, print)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    algorithm = SGRPO()
    done = [Completion(c, [0.0] * len(c), "stop", 0) for c in completions]
    batch = rollout_tensors([prompt_ids] * len(done), done, tokenizer.pad_token_id)
    batch = {k: v.to(device) for k, v in batch.items()}
    batch.update(
        rewards=torch.tensor([1.0, 0.0] * (len(done) // 2), device=device),
        group_size=2,
        group=torch.arange(len(done), device=device) // 2,
        prompt_len=torch.full((len(done),), len(prompt_ids), device=device),
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    tokens, seconds = 0, 0.0
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with autocast:
            mb = {**batch, **_forward(model, None, batch, temperature=1.0)}
            mb["logp_old"] = mb["logp"].detach()  # one update per rollout: π_old = π_θ
            mb["tis_weight"] = torch.ones_like(mb["mask"])
            mb.update(algorithm.advantages(mb)[0])
            loss, _ = algorithm.loss(mb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step >= args.warmup:
            tokens += int(batch["attention_mask"].sum())
            seconds += time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "loss": float(loss)}


# ----------------------------------------------------------------------------- TRL


def _trl_common(args, workdir: Path, steps: int) -> dict:
    return dict(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        bf16=args.device == "cuda",
        fp16=False,
        use_cpu=args.device == "cpu",
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        report_to="none",
        eval_strategy="no",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=args.seed,
    )


class _Clock:
    """Times TRL's steps (on_step_begin .. on_step_end) after the warm-up ones."""

    def __init__(self, warmup: int):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, *a, **k):
                clock.begin = time.perf_counter()

            def on_step_end(self, *a, **k):
                clock.steps.append(time.perf_counter() - clock.begin)

        self.warmup, self.steps, self.callback = warmup, [], Callback()

    @property
    def seconds(self) -> float:
        return sum(self.steps[self.warmup :])


def trl_sft(args, workdir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from oxrl_core.data.encode import prepare_examples
    from oxrl_core.data.sources import load_source

    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    examples = prepare_examples(
        load_source(str(workdir / "sft.jsonl"), "train"), "prompt_response", tokenizer, 4096
    ).examples
    steps = args.warmup + args.steps
    rows = [examples[i % len(examples)] for i in range(steps * args.batch)]
    dataset = Dataset.from_list(
        [{"input_ids": e["input_ids"], "completion_mask": [int(x != IGNORE) for x in e["labels"]]} for e in rows]
    )
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32, attn_implementation="sdpa")
    clock = _Clock(args.warmup)
    config = SFTConfig(
        **_trl_common(args, workdir, steps),
        packing=False,
        padding_free=False,
        completion_only_loss=True,
        max_length=4096,
    )
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock.callback]
    )
    trainer.train()
    tokens = sum(len(e["input_ids"]) for e in rows[args.warmup * args.batch :])
    return {"tokens": tokens, "seconds": clock.seconds}


def trl_dpo(args, workdir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    base = [json.loads(line) for line in (workdir / "dpo.jsonl").read_text().splitlines()]
    steps = args.warmup + args.steps
    rows = [base[i % len(base)] for i in range(steps * args.batch)]
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in rows
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32, attn_implementation="sdpa")
    clock = _Clock(args.warmup)
    config = DPOConfig(
        **_trl_common(args, workdir, steps),
        beta=0.1,
        loss_type="sigmoid",
        max_length=None,
        padding_free=False,
        precompute_ref_log_probs=False,
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=None,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock.callback],
    )
    trainer.train()
    data = trainer.train_dataset
    tokens = sum(
        2 * len(data[j]["prompt_ids"]) + len(data[j]["chosen_ids"]) + len(data[j]["rejected_ids"])
        for j in range(args.warmup * args.batch, steps * args.batch)
    )
    return {"tokens": tokens, "seconds": clock.seconds}


def trl_grpo(args, workdir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tokenizer, prompt_ids, completions = rollout_rows(workdir)
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32, attn_implementation="sdpa")
    common = _trl_common(args, workdir, 1)
    config = GRPOConfig(
        **common, num_generations=2, loss_type="dapo", beta=0.0, epsilon=0.2, max_completion_length=4096
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 4),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    width = max(map(len, completions))
    completion_ids = torch.tensor([c + [tokenizer.pad_token_id] * (width - len(c)) for c in completions], device=device)
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions], device=device)
    inputs = {
        "prompt_ids": torch.tensor([prompt_ids] * len(completions), device=device),
        "prompt_mask": torch.ones(len(completions), len(prompt_ids), dtype=torch.long, device=device),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([0.7071, -0.7071] * (len(completions) // 2), device=device),
        "num_items_in_batch": completion_mask.sum(),
    }
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    tokens, seconds = 0, 0.0
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with autocast:
            loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step >= args.warmup:
            tokens += len(completions) * len(prompt_ids) + int(completion_mask.sum())
            seconds += time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "loss": float(loss)}


# ----------------------------------------------------------------------------- VLM SFT (Gemma-3, image rows)

#: Gemma-3's vocabulary (its checkpoints' ``vocab_size``): the VLM row's model has it, the tokenizer far fewer ids
GEMMA3_VOCAB = 262_208
#: pixels per side of a patch of the VLM row's SigLIP tower, and image tokens per image after Gemma-3's pooling
VLM_PATCH, VLM_IMAGE_TOKENS = 8, 16


def setup_vlm(workdir: Path, args) -> dict:
    """A Gemma-3 VLM built from its config classes (random weights; a SigLIP tower of 2 layers, hidden 64, on
    ``--vlm-image``-pixel images; the language model at ``--hidden`` × ``--layers`` with ``--vlm-vocab`` ids, tied
    embeddings as Gemma-3's), the tests' Gemma-3 tokenizer and chat template (`tests/vlm_archs.py`, a byte-level BPE
    of 570 ids), its PIL processor (no torchvision), and image rows: ``<image>`` + a ~60-token question, a response
    of ~``--vlm-row-tokens`` minus the prompt, one PNG picture each (files beside ``vlm.jsonl``)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    import transformers as tf
    from PIL import Image, ImageDraw
    from vlm_archs import build_tokenizer

    tokenizer = build_tokenizer("gemma3")
    ids = tokenizer.convert_tokens_to_ids
    head_dim = 64
    text = tf.Gemma3TextConfig(
        vocab_size=args.vlm_vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // head_dim),
        num_key_value_heads=1,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=512,
        layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(args.layers - 1)]
        + ["full_attention"],
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = tf.SiglipVisionConfig(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=1,
        image_size=args.vlm_image,
        patch_size=VLM_PATCH,
    )
    config = tf.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=VLM_IMAGE_TOKENS,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # the projector starts at zero (a real checkpoint's is trained): image features would be 0
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.5)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    processor = tf.Gemma3Processor(
        tf.Gemma3ImageProcessorPil(size={"height": args.vlm_image, "width": args.vlm_image}),
        tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=VLM_IMAGE_TOKENS,
    )
    model.save_pretrained(workdir / "vlm-model")
    processor.save_pretrained(workdir / "vlm-model")

    rng = random.Random(args.seed)
    (workdir / "vlm-images").mkdir(exist_ok=True)
    rows, side = [], args.vlm_image
    per_char = 0.76  # tokens per character of `_filler` text with this tokenizer
    response_chars = int(max(8, args.vlm_row_tokens - 60 - VLM_IMAGE_TOKENS) / per_char)
    for i in range(args.batch * 8):
        image = Image.new("RGB", (side, side), tuple(rng.randint(0, 60) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(3):
            x, y, w = rng.randint(0, side - 8), rng.randint(0, side - 8), rng.randint(4, side // 2)
            fill = tuple(rng.randint(80, 255) for _ in range(3))
            (draw.rectangle if rng.random() < 0.5 else draw.ellipse)((x, y, x + w, y + w), fill=fill)
        image.save(workdir / "vlm-images" / f"{i}.png")
        question = "<image>Describe the picture, then continue the chain. " + _filler(rng, 40)
        rows.append(
            {
                "prompt": question,
                "images": [f"vlm-images/{i}.png"],
                "response": _filler(rng, int(response_chars * rng.uniform(0.9, 1.0))),
            }
        )
    (workdir / "vlm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    vision_params = sum(p.numel() for p in model.model.vision_tower.parameters())
    return {
        "model": f"Gemma-3 (Gemma3ForConditionalGeneration, random weights), {model.num_parameters() / 1e6:.1f}M "
        f"parameters: language model vocabulary {args.vlm_vocab:,}, hidden {args.hidden}, {args.layers} layers, tied "
        f"embeddings; SigLIP tower {vision_params / 1e6:.2f}M ({'trained' if args.vlm_train_vision else 'frozen'}), "
        f"{args.vlm_image}×{args.vlm_image} images, {VLM_IMAGE_TOKENS} image tokens each",
    }


def vlm_plan_rows(workdir: Path, args, steps: int) -> list[dict]:
    """The rows of ``vlm.jsonl`` in the order oxRL's SFT loop deals them (`BatchPlan`, seeded, no length grouping:
    the loop's defaults), ``steps`` × ``--batch`` of them: TRL's sequential sampler then sees the same batches."""
    from oxrl_core.data.batching import BatchPlan

    rows = [json.loads(line) for line in (workdir / "vlm.jsonl").read_text().splitlines()]
    plan = BatchPlan([0] * len(rows), args.batch, args.seed, group_by_length=False)
    return [rows[i] for k in range(steps) for i in plan.micro_batch(k)]


def trl_vlm_examples(workdir: Path, rows: list[dict], processor) -> list[dict]:
    """The rows in TRL's standard prompt-completion format for vision datasets: ``images`` (PIL), ``prompt`` = the
    prompt as the processor's chat template renders it with the generation prompt (the text oxRL's processor encodes),
    ``completion`` = the response and the EOS token (oxRL's completion tokens: the response's, then EOS)."""
    from PIL import Image

    from oxrl_core.models.vision import image_messages

    out = []
    for row in rows:
        images = [Image.open(workdir / path).convert("RGB") for path in row["images"]]
        messages = image_messages(row["prompt"], images)
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append({"images": images, "prompt": prompt, "completion": row["response"] + processor.tokenizer.eos_token})
    return out


#: largest |Δ| between the two sides' step-1 losses (nats): fp32 on the CPU, bf16 autocast on a GPU
VLM_LOSS_TOLERANCE = (1e-4, 5e-2)


def vlm_info(workdir: Path, args, model: dict, with_trl: bool) -> dict:
    """What the VLM row trains on, and (with TRL) the check that TRL's collator gives oxRL's inputs."""
    if with_trl:
        tokens = check_vlm_tokens(workdir, args)
    else:
        from oxrl_core.data.encode import prepare_examples
        from oxrl_core.data.sources import load_source
        from oxrl_core.models.vision import load_processing

        vision = load_processing(str(workdir / "vlm-model"))
        source = load_source(str(workdir / "vlm.jsonl"), "train")
        examples = prepare_examples(source, "prompt_response", vision.tokenizer, 4096, vision=vision).examples
        tokens = {
            "rows": len(examples),
            "tokens_per_row": sum(len(e["input_ids"]) for e in examples) / len(examples),
            "labelled_per_row": sum(x != IGNORE for e in examples for x in e["labels"]) / len(examples),
        }
    work = (
        f"{tokens['rows']} image rows of {tokens['tokens_per_row']:.0f} tokens on average ({tokens['labelled_per_row']:.0f}"
        f" labelled), batch {args.batch}"
    )
    return {**model, **tokens, "work": work, "same_inputs": with_trl}


def check_vlm_tokens(workdir: Path, args) -> dict:
    """Both sides train on the same tokens: for every row of the measured run, TRL's collator
    (`DataCollatorForVisionLanguageModeling`, completion-only loss) gives the token ids, loss labels, Gemma-3
    ``token_type_ids`` and pixels that oxRL's data loading (`prepare_examples` through the model's processor) gives.
    Raises when they differ; returns the token counts."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from oxrl_core.data.encode import prepare_examples
    from oxrl_core.data.sources import load_source
    from oxrl_core.models.vision import load_processing

    vision = load_processing(str(workdir / "vlm-model"))
    source = load_source(str(workdir / "vlm.jsonl"), "train")
    examples = prepare_examples(source, "prompt_response", vision.tokenizer, 4096, vision=vision).examples
    rows = [json.loads(line) for line in (workdir / "vlm.jsonl").read_text().splitlines()]
    collator = DataCollatorForVisionLanguageModeling(vision.processor, max_length=4096, completion_only_loss=True)
    batch = collator(trl_vlm_examples(workdir, rows, vision.processor))
    tokens = labelled = 0
    for i, ex in enumerate(examples):
        keep = batch["attention_mask"][i].bool()
        type_ids = ex["token_inputs"]["token_type_ids"]
        same = (
            batch["input_ids"][i][keep].tolist() == ex["input_ids"]
            and batch["labels"][i][keep].tolist() == ex["labels"]
            # oxRL keeps the prompt's token_type_ids (its collator pads the completion's with 0, as TRL's are)
            and batch["token_type_ids"][i][keep].tolist() == type_ids + [0] * (len(ex["input_ids"]) - len(type_ids))
            and torch.equal(batch["pixel_values"][i], ex["pixel_inputs"]["pixel_values"][0])
        )
        if not same:
            raise RuntimeError(f"vlm row {i}: TRL's collator and oxRL's data loading give different inputs")
        tokens += len(ex["input_ids"])
        labelled += sum(x != IGNORE for x in ex["labels"])
    return {
        "rows": len(examples),
        "tokens_per_row": tokens / len(examples),
        "labelled_per_row": labelled / len(examples),
    }


def trl_vlm_sft(args, workdir: Path, masked: bool = False) -> dict:
    """TRL's `SFTTrainer` on the image rows (its vision path: a processor as ``processing_class``, an ``images``
    column, `DataCollatorForVisionLanguageModeling`), the vision tower frozen as oxRL's default freezes it.

    ``masked`` (the loss check's run, ``vlm:trl-masked``; not measured): the policy oxRL trains, whose logits of the
    tokens a VLM never samples are at -1e9 (`vlm_archs.NEVER_SAMPLED`, the tests' own list). TRL's default loss runs
    a fused LM head no hook reaches, so that run takes TRL's `compute_loss_func` route: the model's full logits
    (masked by a hook on the head) and the token-mean cross-entropy over TRL's labels. The measured run (``trl``)
    is TRL's default route, fused head and all."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    from oxrl_core.models.vision import freeze_vision

    sys.path.insert(0, str(ROOT / "tests"))
    from vlm_archs import never_sampled_ids

    processor = AutoProcessor.from_pretrained(workdir / "vlm-model")
    steps = args.warmup + args.steps
    dataset = Dataset.from_list(trl_vlm_examples(workdir, vlm_plan_rows(workdir, args, steps), processor))
    model = AutoModelForImageTextToText.from_pretrained(
        workdir / "vlm-model", dtype=torch.float32, attn_implementation="sdpa"
    )
    if not args.vlm_train_vision:
        freeze_vision(model)
    never = torch.tensor(never_sampled_ids("gemma3", processor.tokenizer))

    def masked_nll(outputs, labels, num_items_in_batch=None):
        logits, targets = outputs.logits[:, :-1].float(), labels[:, 1:]  # position t predicts token t+1
        total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        count = num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum()
        return total / count

    if masked:
        model.get_output_embeddings().register_forward_hook(
            lambda m, i, out: out.index_fill(-1, never.to(out.device), -1e9)
        )
    clock, losses, counts = _Clock(args.warmup), [], []

    class Trainer(SFTTrainer):
        def compute_loss(self, model, inputs, *a, **k):
            loss = super().compute_loss(model, inputs, *a, **k)
            losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    config = SFTConfig(
        **_trl_common(args, workdir, steps),
        packing=False,
        padding_free=False,
        completion_only_loss=True,
        max_length=4096,
    )
    trainer = Trainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=processor,
        callbacks=[clock.callback],
        compute_loss_func=masked_nll if masked else None,
    )
    collate = trainer.data_collator

    def counting(examples):
        batch = collate(examples)
        counts.append(int(batch["attention_mask"].sum()))  # real tokens, image tokens included (as oxRL counts)
        return batch

    trainer.data_collator = counting
    trainer.train()
    return {
        "tokens": sum(counts[args.warmup : steps]),
        "seconds": clock.seconds,
        "first_loss": losses[0],
        "losses": losses,
    }


# ----------------------------------------------------------------------------- one configuration per process


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    workload, side = args.child.split(":")
    workdir = Path(args.workdir)
    chunk = 0 if side == "oxrl-plain" else args.chunk
    if side == "trl-masked":  # the VLM row's loss check (`trl_vlm_sft`)
        result = trl_vlm_sft(args, workdir, masked=True)
    elif side == "trl":
        result = {"sft": trl_sft, "dpo": trl_dpo, "sgrpo": trl_grpo, "vlm": trl_vlm_sft}[workload](args, workdir)
    elif workload == "sgrpo":
        result = oxrl_sgrpo(args, workdir, chunk)
    else:
        result = oxrl_sl(workload, args, workdir, chunk)
    if args.device == "cuda":
        result["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    else:
        result["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB
    print("RESULT " + json.dumps(result), flush=True)


def run_child(argv: list[str], workload: str, side: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": argv[argv.index("--threads") + 1], "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, __file__, *argv, "--child", f"{workload}:{side}"], env=env, capture_output=True, text=True
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{workload}:{side} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    ap.add_argument("--vlm-sides", default="", help="the VLM row's sides, when not --sides (one call, two side lists)")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--row-tokens", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vlm-vocab", type=int, default=GEMMA3_VOCAB, help="the VLM row's vocabulary (Gemma-3's)")
    ap.add_argument("--vlm-row-tokens", type=int, default=1000, help="the VLM row's tokens per image row")
    ap.add_argument("--vlm-image", type=int, default=64, help="the VLM row's image side, pixels (8-pixel patches)")
    ap.add_argument("--vlm-train-vision", action="store_true", help="the VLM row trains the vision tower too")
    ap.add_argument("--chunk", type=int, default=1024, help="oxrl's train.logits_chunk_size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--device", default="", help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.device:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        return child(args)
    sides = [s for s in args.sides.split(",") if s]
    vlm_sides = [s for s in args.vlm_sides.split(",") if s] or list(sides)
    if "trl" in sides + vlm_sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed: skipping the TRL side (pip install trl)")
            sides, vlm_sides = [s for s in sides if s != "trl"], [s for s in vlm_sides if s != "trl"]
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="oxrl-memory-"))
    workdir.mkdir(parents=True, exist_ok=True)
    workloads = [w for w in args.only.split(",") if w]
    if set(workloads) - set(WORKLOADS):
        ap.error(f"unknown workloads {sorted(set(workloads) - set(WORKLOADS))}; known: {', '.join(WORKLOADS)}")
    if set(workloads) - {"vlm"}:
        setup(workdir, args)
    vlm_model = setup_vlm(workdir, args) if "vlm" in workloads else {}
    argv = [
        a
        for pair in (
            ("--workdir", str(workdir)),
            ("--threads", str(args.threads)),
            ("--device", args.device),
            ("--steps", str(args.steps)),
            ("--warmup", str(args.warmup)),
            ("--batch", str(args.batch)),
            ("--chunk", str(args.chunk)),
            ("--seed", str(args.seed)),
        )
        for a in pair
    ] + (["--vlm-train-vision"] if args.vlm_train_vision else [])
    print(
        (
            f"model: Llama, vocabulary {args.vocab:,}, {args.layers} layers, hidden {args.hidden}; batch {args.batch} × "
            f"~{args.row_tokens} tokens; "
            if set(workloads) - {"vlm"}
            else ""
        )
        + f"device {args.device}, {args.threads} threads; oxrl chunk {args.chunk}",
        flush=True,
    )
    figures: dict = {}
    vlm: dict = {}
    try:
        for workload in workloads:
            if workload == "vlm":
                vlm = vlm_info(workdir, args, vlm_model, "trl" in vlm_sides)
                print(f"  vlm: {vlm['model']}; {vlm['work']}", flush=True)
            results = {}
            for side in vlm_sides if workload == "vlm" else sides:
                r = run_child(argv, workload, side)
                results[side] = r
                print(
                    f"  {workload:5s} {side:10s} peak {r['peak_gb']:6.2f} GB   {r['tokens'] / r['seconds']:8.1f} tokens/s",
                    flush=True,
                )
            if workload == "vlm":  # step 1's loss (before any update) of each side: the same rows, the same model
                vlm["first_loss"] = {side: round(r["first_loss"], 6) for side, r in results.items()}
                if "oxrl" in results and "trl" in results:
                    # the loss check: TRL on oxRL's objective (the never-sampled tokens masked; `trl_vlm_sft`)
                    check = run_child(argv, workload, "trl-masked")
                    vlm["first_loss"]["trl-masked"] = round(check["first_loss"], 6)
                    diff = abs(results["oxrl"]["first_loss"] - check["first_loss"])
                    vlm["first_loss_diff"] = diff
                    tol = VLM_LOSS_TOLERANCE[args.device == "cuda"]
                    print(
                        f"  vlm   step-1 loss oxrl {results['oxrl']['first_loss']:.6f}, trl (never-sampled tokens "
                        f"masked) {check['first_loss']:.6f}: |Δ| {diff:.2e} ({'≤' if diff <= tol else 'NOT ≤'} {tol}); "
                        f"TRL's own loss {results['trl']['first_loss']:.6f} (the placeholders' mass in it)",
                        flush=True,
                    )
                    if diff > tol:
                        raise RuntimeError(f"vlm: the two sides' step-1 losses differ by {diff:.2e} (> {tol})")
                    # after the updates too (the same trainable parameters, the same AdamW): reported, not enforced
                    pairs = list(zip(results["oxrl"]["losses"], check["losses"]))
                    vlm["loss_diff_per_step"] = [abs(a - b) for a, b in pairs]
                    print(f"  vlm   per-step loss |Δ| {', '.join(f'{d:.1e}' for d in vlm['loss_diff_per_step'])}")
            entry = {
                side: {"peak_gb": round(r["peak_gb"], 3), "tokens_per_s": round(r["tokens"] / r["seconds"], 1)}
                for side, r in results.items()
            }
            for base in ("trl", "oxrl-plain"):
                if "oxrl" in results and base in results:
                    mem = results["oxrl"]["peak_gb"] / results[base]["peak_gb"]
                    speed = (results["oxrl"]["tokens"] / results["oxrl"]["seconds"]) / (
                        results[base]["tokens"] / results[base]["seconds"]
                    )
                    entry[f"oxrl/{base}"] = {"peak": round(mem, 3), "tokens_per_s": round(speed, 3)}
                    print(f"  {workload:5s} oxrl / {base:10s} peak {mem:.2f}×, tokens/s {speed:.2f}×", flush=True)
            figures[workload] = entry
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if "trl" in figures.get("sft", {}) and "oxrl" in figures.get("sft", {}):
        r = figures["sft"]["oxrl/trl"]["peak"]
        print(f"SFT: oxrl / trl peak = {r:.2f}× (goal ≤ 0.5: {'met' if r <= 0.5 else 'NOT met'})")
    if "oxrl/oxrl-plain" in figures.get("sft", {}):
        r = figures["sft"]["oxrl/oxrl-plain"]["tokens_per_s"]
        print(f"SFT: oxrl tokens/s / oxrl-plain = {r:.2f}× (goal ≥ 0.95: {'met' if r >= 0.95 else 'NOT met'})")
    print(
        json.dumps(
            {
                "figures": figures,
                "device": args.device,
                "vocab": args.vocab,
                "hidden": args.hidden,
                "layers": args.layers,
                "batch": args.batch,
                "row_tokens": args.row_tokens,
                "chunk": args.chunk,
                "steps": args.steps,
                "warmup": args.warmup,
                "threads": args.threads,
                **({"vlm": vlm} if vlm else {}),
            }
        )
    )


if __name__ == "__main__":
    main()
