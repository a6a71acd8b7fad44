"""edgepack.runtime_shim."""
