"""How long `topk prefill` takes to decide which files under a folder are documents (the walk, no reading).

    python scripts/document_walk.py DIR [--include GLOB ...] [--exclude GLOB ...]

Times `list_files` (the folder walk: default skips, .gitignore, --include/--exclude) and prints the
files found, the entries skipped and the seconds. Run it from a checkout (PYTHONPATH=.) to time that
checkout's walk; `--include`/`--exclude` are passed only when given, so an older checkout runs it too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from topk_decode.prefill.documents import list_files


def main() -> None:
    """Time one walk of DIR."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--include", action="append", default=[])
    ap.add_argument("--exclude", action="append", default=[])
    args = ap.parse_args()
    rules = {k: v for k, v in (("include", args.include), ("exclude", args.exclude)) if v}
    t0 = time.perf_counter()
    files, skipped = list_files(args.dir, **rules)
    print(f"{len(files)} files, {len(skipped)} skipped, {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
