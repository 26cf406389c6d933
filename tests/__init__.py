"""moecore's test suite (a package, so that its folders do not shadow installed packages such as `kernels`)."""
