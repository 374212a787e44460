"""Model definitions (compositions of parallel layers) and their registry."""
