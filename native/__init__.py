"""edgepack.native: loader for the compiled kernels."""
