"""Experiments: sweeps over server and client settings (`loadlab sweep`)."""
