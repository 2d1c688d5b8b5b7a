def count_up(n):
    """Return [1, 2, ..., n]; [] when n < 1."""
    return list(range(1, n))
