"""oxRL supervised algorithms: SFT, CPT, KD (one file each)."""
