"""Speculation decisions on the driver: acceptance estimates, cost model, draft lengths."""
