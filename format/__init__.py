"""edgepack.format."""
