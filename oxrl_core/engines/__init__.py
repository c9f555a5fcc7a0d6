"""Training engines: own the model's device, precision, optimiser and scheduler."""
