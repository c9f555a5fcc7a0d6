"""Training loops, one per algorithm family."""
