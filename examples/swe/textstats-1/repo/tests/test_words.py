from textstats import longest_word, word_count


def test_word_count_simple():
    assert word_count("one two three") == 3


def test_word_count_empty():
    assert word_count("") == 0


def test_longest_word():
    assert longest_word("a bbb cc") == "bbb"
