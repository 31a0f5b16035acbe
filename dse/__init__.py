"""dse: design-space exploration of distributed AI systems."""
