"""The command line shared by the scripts that generate docs pages: write them, or ``--check`` that they are current."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def page_main(pages: dict[Path, Callable[[], str]], script: str, doc: str, argv=None) -> int:
    """Write each page's ``render()``; with ``--check``, exit 1 (saying which script to run) if one differs."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated page is out of date")
    args = parser.parse_args(argv)
    stale = []
    for page, render in pages.items():
        text = render()
        if args.check:
            if not (page.is_file() and page.read_text() == text):
                stale.append(page.name)
        else:
            page.write_text(text)
            print(f"wrote {page}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python {script}")
    elif args.check:
        print(f"up to date: {', '.join(p.name for p in pages)}")
    return 1 if stale else 0
