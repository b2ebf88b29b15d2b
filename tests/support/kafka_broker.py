"""Placeholder: fixtures for a real Kafka-protocol broker (being written)."""
