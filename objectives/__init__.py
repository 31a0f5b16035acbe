"""Metrics and constraints."""
