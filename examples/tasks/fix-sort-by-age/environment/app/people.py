def sort_people(people):
    """`people` is a list of (name, age); return it sorted by age, youngest first, stable."""
    return sorted(people, key=lambda p: p[1], reverse=True)
