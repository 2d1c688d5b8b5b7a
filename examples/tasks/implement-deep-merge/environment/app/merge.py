def deep_merge(base, override):
    """A new dict: `base` updated with `override`, recursing where both values are dicts. Neither input is
    modified."""
    raise NotImplementedError
