"""Checkpoint admission: which quantization schemes moonep serves, and the check of a checkpoint's files before any engine starts."""
