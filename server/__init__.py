"""edgepack.server."""
