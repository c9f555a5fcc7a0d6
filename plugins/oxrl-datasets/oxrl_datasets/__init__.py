"""oxRL dataset plugins: well-known datasets mapped to oxRL's row formats (`oxrl_core.DataFormat`;
the fields of each: ``docs/architecture.md``).

One module per dataset, each with its exact mapping in its docstring:
`gsm8k`, `hendrycks_math` (``math``), `openr1_math`, `ultrafeedback` (``ultrafeedback_binarized``),
`hh_rlhf`, `alpaca`, and `mapped` (``hf``: any `datasets` dataset with a field mapping).
`sources` holds what they share: reading a local copy or the hub, and the source-row checks;
the answer extraction and checks behind ``verify`` are the core's (`oxrl_core.answers`, shared with
oxrl-rewards).
"""
