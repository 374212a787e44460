"""Container images: the mmdebstrap base, both Dockerfile targets, containerd import."""
