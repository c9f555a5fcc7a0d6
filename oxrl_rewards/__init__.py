"""oxRL rewards, one file each; imported lazily (discovery only reads `registration`)."""
