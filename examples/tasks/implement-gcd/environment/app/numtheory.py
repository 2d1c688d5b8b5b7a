def gcd(a, b):
    """Greatest common divisor of two non-negative integers; gcd(0, 0) == 0."""
    raise NotImplementedError
