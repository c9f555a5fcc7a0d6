"""models: loading a policy, reference, teacher or reward model and what is built around it — the tokenizer
and chat template (`loading`), LoRA through PEFT (`lora`), the PPO critic head (`critic`), packed attention
(`packed_attention`), the chunked LM head that yields per-token log-probabilities without a (B, T, V) tensor
(`token_head`), the built-in tiny model (`tiny`) and tiny VLM (`tiny_vlm`), vision-language models (`vision`:
own-class loading, the processor, the per-family table) and FLOPs/MFU (`perf`).

May import: the leaves, `interfaces`, `config`, `engines`, `observability`, `data`.
"""
