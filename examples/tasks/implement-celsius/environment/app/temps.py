def c_to_f(celsius):
    """Degrees Celsius to Fahrenheit."""
    raise NotImplementedError


def f_to_c(fahrenheit):
    """Degrees Fahrenheit to Celsius."""
    raise NotImplementedError
