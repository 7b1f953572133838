"""Extensions in one file each, run through the whole tool (test_extensions.py)."""
