"""Kernel and telemetry sources for the collector."""
