"""Prefetch, grouped expert compute and the reference MoonEP buffer."""
