def chunk(items, size):
    """Split the list `items` into lists of `size` items (the last may be shorter); ValueError when size < 1."""
    raise NotImplementedError
