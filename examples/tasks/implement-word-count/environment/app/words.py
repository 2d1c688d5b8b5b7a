def word_count(text):
    """Return a dict mapping each lower-cased word (a run of letters) in `text` to how often it occurs."""
    raise NotImplementedError
