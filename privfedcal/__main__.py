"""``python -m privfedcal``: the same as the ``privfedcal`` command."""

from privfedcal.cli.main import main

if __name__ == "__main__":
    main()
