def slugify(text):
    """Lower-case `text`, replace every run of characters that are not a-z or 0-9 with a single '-', and strip
    leading and trailing '-'. slugify('Hello, World!') == 'hello-world'."""
    raise NotImplementedError
