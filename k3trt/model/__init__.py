"""Kimi K3 in plain PyTorch: one definition that every backend is checked against."""
