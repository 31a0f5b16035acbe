"""Measured kernel tables: where they come from (`source`) and how a kernel call is read from them."""
