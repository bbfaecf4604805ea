"""Inference backends behind one interface (backends.base.Backend)."""
