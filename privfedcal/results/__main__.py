"""``python -m privfedcal.results --markdown`` prints the section "Result types" of
``docs/api.md``; ``--write [PAGE]`` rewrites it in the page (default: this checkout's
``docs/api.md``)."""

import argparse
import sys
from pathlib import Path

from privfedcal.results.markdown import section, write

DEFAULT_PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m privfedcal.results",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the generated section")
    group.add_argument("--write", nargs="?", const=DEFAULT_PAGE, type=Path, metavar="PAGE",
                       help="rewrite the section in PAGE (default: docs/api.md)")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(section())
        return 0
    if not args.write.is_file():
        parser.error(f"no such page: {args.write}")
    changed = write(args.write)
    print(f"{args.write}: {'rewritten' if changed else 'already up to date'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
