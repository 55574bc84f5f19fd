"""Paged attention backends: the interface (backend.py), plain torch (reference.py), Triton (triton.py)."""
