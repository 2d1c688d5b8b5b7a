"""Counting words in a text."""


def word_count(text: str) -> int:
    """The number of words in `text`: runs of characters between whitespace."""
    return len([word for word in text.split(" ") if word != ""])


def longest_word(text: str) -> str:
    """The longest word of `text` (the first one on a tie); "" for a text without words."""
    best = ""
    for word in text.split(" "):
        if len(word) > len(best):
            best = word
    return best
