def fizzbuzz(n):
    """Return a list of strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for
    multiples of both, else the number itself as a string."""
    raise NotImplementedError
