"""edgepack.packager."""
