"""GPU tests (a package, so that their module names may repeat those of the CPU tests in tests/)."""
