def roman_to_int(numeral):
    """The value of a Roman numeral in standard form: roman_to_int('MCMXCIV') == 1994."""
    raise NotImplementedError
