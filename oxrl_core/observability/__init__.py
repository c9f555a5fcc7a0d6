"""observability: what a run shows about itself — the console progress while it runs (`progress`), the health
findings read from its files (`health`), and the self-contained HTML report (`oxrl report`: `run_files` reads a
run directory defensively, `charts` draws inline SVG, `report` writes the page).

May import: the leaves, `interfaces`, `config`, `engines` (to know the main rank). Nothing here imports torch.
"""
