"""data: where rows come from and how they become batches.

- `sources`: files, directories, saved datasets, dataset plugins, hub ids, mixtures of them
- `rows`: every row checked against its format when the data loads (file, row and field named)
- `encode`: the tokenisation convention (chat template, completion + EOS, labels)
- `batching`: deterministic micro-batch plans, token budgets, the collator
- `task`: the built-in offline task (arithmetic prompts with answers)
- `shapes`: the built-in visual task (questions about generated 32×32 pictures)
- `images`: images in rows decoded (paths, base64, bytes) and checked (prompt side only, one per placeholder), and
  a micro-batch's pixel inputs joined row by row

May import: the leaves (errors, chat_templates), `interfaces`, `config`, `engines`, `observability`. Nothing here
imports torch at module level.
"""
