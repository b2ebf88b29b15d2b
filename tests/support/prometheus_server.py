"""Placeholder: fixtures for a real Prometheus server (being written)."""
