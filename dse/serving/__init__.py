"""Serving: a deployment under a load, priced from engine iterations (`iteration`), as a closed-form steady state
(`steady`) or a request-level event simulation (`events`)."""
