"""edgepack.cli."""
