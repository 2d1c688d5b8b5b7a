def is_palindrome(text):
    """True when `text` reads the same backwards, ignoring case and every character that is not a letter or a
    digit. is_palindrome('A man, a plan, a canal: Panama') is True."""
    raise NotImplementedError
