def average(values):
    """Arithmetic mean of `values`; 0.0 for an empty list."""
    return sum(values) / len(values)
