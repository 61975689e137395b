"""The kvbaton tests, a package: shared code is imported from `tests.support`, from the repository root."""
