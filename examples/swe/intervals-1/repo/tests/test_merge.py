from intervals import merge, total_length


def test_disjoint_stay_apart():
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]


def test_overlapping_merge():
    assert merge([(1, 4), (2, 6)]) == [(1, 6)]


def test_total_length():
    assert total_length([(1, 4), (2, 6), (10, 11)]) == 6
