def flatten(items):
    """Flatten arbitrarily nested lists: flatten([1, [2, [3, []], 4]]) == [1, 2, 3, 4]."""
    raise NotImplementedError
