"""Cost models."""
