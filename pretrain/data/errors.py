"""The one exception type the data package raises for user-facing problems."""


class DataError(ValueError):
    """A dataset or corpus problem, described in one readable line."""
