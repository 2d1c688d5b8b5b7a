def reverse_words(sentence):
    """'hello big world' -> 'world big hello'."""
    return sentence[::-1]
