def caesar(text, shift):
    """Shift each ASCII letter by `shift` places in the alphabet (wrapping, case kept); other characters
    unchanged. caesar('abc xyz', 2) == 'cde zab'."""
    raise NotImplementedError
