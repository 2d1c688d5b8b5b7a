def parse_pairs(text):
    """Parse 'a=1; b = 2' into {'a': '1', 'b': '2'}: pairs separated by ';', key and value stripped of
    whitespace, empty pairs skipped."""
    raise NotImplementedError
