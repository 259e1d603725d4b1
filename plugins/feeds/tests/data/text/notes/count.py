def tally(marks):
    """How many marks are above the line."""
    return sum(1 for mark in marks if mark > 0)
